package arrowflight

import (
	"encoding/binary"
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
)

// Sending a micro-batch the ordinary way copies its bytes three times before they reach
// the socket: into one contiguous IPC body, into the protobuf encoding of FlightData, and
// into HTTP/2 frames. floe sends record batches as bodyFrames instead, which the server's
// codec encodes as the FlightData wire format whose body pieces point at the record's own
// buffers: the HTTP/2 framing is the only copy left. Clients see ordinary FlightData.
//
// The pieces stay referenced by gRPC after SendMsg returns, so the record's memory must be
// managed by Go's garbage collector: memory.GoAllocator, or a CheckedAllocator over it.

// bodyFrame is one FlightData message whose body is gathered, not copied.
type bodyFrame struct {
	header  []byte   // IPC message metadata (flatbuffer)
	appMeta []byte   // FlightData app_metadata
	body    [][]byte // IPC body buffers and their padding, in order
	size    int
}

// Write records p as the next body piece without copying it; ipc.Payload.SerializeBody
// calls it for every buffer and padding run.
func (f *bodyFrame) Write(p []byte) (int, error) {
	f.body = append(f.body, p)
	f.size += len(p)
	return len(p), nil
}

// Protobuf field keys of FlightData (Flight.proto): data_header = 2, app_metadata = 3,
// data_body = 1000, all length-delimited.
const (
	keyDataHeader  = 2<<3 | 2
	keyAppMetadata = 3<<3 | 2
	keyDataBody    = 1000<<3 | 2
)

// codec encodes bodyFrames itself and everything else as protobuf.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2("proto")} }

func (codec) Name() string { return "proto" }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	f, ok := v.(*bodyFrame)
	if !ok {
		return c.proto.Marshal(v)
	}
	prefix := make([]byte, 0, len(f.header)+len(f.appMeta)+32)
	prefix = binary.AppendUvarint(prefix, keyDataHeader)
	prefix = binary.AppendUvarint(prefix, uint64(len(f.header)))
	prefix = append(prefix, f.header...)
	if len(f.appMeta) > 0 {
		prefix = binary.AppendUvarint(prefix, keyAppMetadata)
		prefix = binary.AppendUvarint(prefix, uint64(len(f.appMeta)))
		prefix = append(prefix, f.appMeta...)
	}
	if f.size > 0 {
		prefix = binary.AppendUvarint(prefix, keyDataBody)
		prefix = binary.AppendUvarint(prefix, uint64(f.size))
	}
	out := make(mem.BufferSlice, 0, len(f.body)+1)
	out = append(out, mem.SliceBuffer(prefix))
	for _, b := range f.body {
		out = append(out, mem.SliceBuffer(b))
	}
	return out, nil
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// streamWriter writes an Arrow IPC stream of record batches as FlightData, sending the
// bodies zero-copy.
type streamWriter struct {
	stream flight.FlightService_DoGetServer
	mem    memory.Allocator
	schema *arrow.Schema
	sent   bool
}

func (w *streamWriter) start() error {
	p := ipc.GetSchemaPayload(w.schema, w.mem)
	defer p.Release()
	meta := p.Meta()
	defer meta.Release()
	w.sent = true
	return w.stream.Send(&flight.FlightData{DataHeader: meta.Bytes()})
}

// write sends rec with appMeta and returns the bytes of the message (IPC header, app
// metadata and body). rec may be released as soon as write returns.
func (w *streamWriter) write(rec arrow.RecordBatch, appMeta []byte) (int, error) {
	if !w.sent {
		if err := w.start(); err != nil {
			return 0, err
		}
	}
	p, err := ipc.GetRecordBatchPayload(rec, ipc.WithAllocator(w.mem))
	if err != nil {
		return 0, fmt.Errorf("encoding a record batch: %w", err)
	}
	defer p.Release()
	meta := p.Meta()
	defer meta.Release()
	f := &bodyFrame{header: meta.Bytes(), appMeta: appMeta}
	if err := p.SerializeBody(f); err != nil {
		return 0, err
	}
	n := len(f.header) + len(f.appMeta) + f.size
	return n, w.stream.SendMsg(f)
}
