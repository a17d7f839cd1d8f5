package bolt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/floe-rl/floe/trace"
)

// A call is stored as one value in its session's calls bucket, keyed by its storage
// sequence number (uint32 big-endian, 0, 1, 2, … in the order Record stored them; n>1
// choices take one sequence number each). The value is:
//
//	varint   Index, Choice, PolicyVersion
//	byte     flags (bit 0: Trainable, bit 1: Sampling present)
//	string   FinishReason, UntrainableReason, API       (uvarint length + bytes)
//	time     Started, Finished                          (uvarint length + MarshalBinary; 0 = zero time)
//	varint   UpstreamLatency (ns)
//	prompt   uvarint ref (0: none, else referenced seq+1), uvarint shared, tokens tail
//	tokens   ResponseIDs
//	uvarint  len(Logprobs), then float32 little-endian each
//	sampling only with flag bit 1: byte (bit 0 temperature, bit 1 top_p, bit 2 top_k set),
//	         then float64 LE temperature, float64 LE top_p, varint top_k, each when set
//	blob     Request, UpstreamRequest, Response          (delta against the previous seq's same field)
//
// tokens are a uvarint count then one zigzag varint per id (1–3 bytes for real vocabularies).
// The prompt is prompt = full(ref)[:shared] ++ tail, where full(j) is call j's
// PromptIDs ++ ResponseIDs; a blob is tag 0 (nil), 1 (uvarint len + bytes) or 2 (uvarint
// prefix, uvarint suffix, uvarint len + middle bytes: prev[:prefix] ++ middle ++
// prev[len(prev)-suffix:]).

// errCorrupt marks a value that does not decode.
var errCorrupt = errors.New("corrupt call record")

type encoder struct{ b []byte }

func (e *encoder) uvarint(v uint64) { e.b = binary.AppendUvarint(e.b, v) }
func (e *encoder) varint(v int64)   { e.b = binary.AppendVarint(e.b, v) }
func (e *encoder) bytes(p []byte)   { e.uvarint(uint64(len(p))); e.b = append(e.b, p...) }
func (e *encoder) str(s string)     { e.uvarint(uint64(len(s))); e.b = append(e.b, s...) }

func (e *encoder) tokens(ids []int32) {
	e.uvarint(uint64(len(ids)))
	for _, id := range ids {
		e.varint(int64(id))
	}
}

func (e *encoder) time(t time.Time) {
	if t.IsZero() {
		e.uvarint(0)
		return
	}
	p, err := t.MarshalBinary()
	if err != nil { // a zone offset that is not whole minutes: keep the instant
		p, _ = t.UTC().MarshalBinary()
	}
	e.bytes(p)
}

// blob writes cur as a delta against prev when that saves bytes.
func (e *encoder) blob(cur, prev []byte) {
	if cur == nil {
		e.b = append(e.b, 0)
		return
	}
	p := 0
	for p < len(cur) && p < len(prev) && cur[p] == prev[p] {
		p++
	}
	s := 0
	for s < len(cur)-p && s < len(prev)-p && cur[len(cur)-1-s] == prev[len(prev)-1-s] {
		s++
	}
	if p+s < 16 {
		e.b = append(e.b, 1)
		e.bytes(cur)
		return
	}
	e.b = append(e.b, 2)
	e.uvarint(uint64(p))
	e.uvarint(uint64(s))
	e.bytes(cur[p : len(cur)-s])
}

// promptRef is how a prompt is stored: the first shared tokens of an earlier call's full
// sequence, then tail.
type promptRef struct {
	ref    int // storage seq of the referenced call, -1 for none
	shared int
}

// encodeCall returns the call's value and how many of its bytes are the recorded JSON.
func encodeCall(c *trace.Call, pr promptRef, prevBlobs *[3][]byte) (val []byte, jsonBytes int) {
	e := encoder{b: make([]byte, 0, 64+3*(len(c.PromptIDs)-pr.shared+len(c.ResponseIDs))+4*len(c.Logprobs))}
	e.varint(int64(c.Index))
	e.varint(int64(c.Choice))
	e.varint(c.PolicyVersion)
	var flags byte
	if c.Trainable {
		flags |= 1
	}
	if c.Sampling != nil {
		flags |= 2
	}
	e.b = append(e.b, flags)
	e.str(c.FinishReason)
	e.str(c.UntrainableReason)
	e.str(c.API)
	e.time(c.Started)
	e.time(c.Finished)
	e.varint(int64(c.UpstreamLatency))
	e.uvarint(uint64(pr.ref + 1))
	e.uvarint(uint64(pr.shared))
	e.tokens(c.PromptIDs[pr.shared:])
	e.tokens(c.ResponseIDs)
	e.uvarint(uint64(len(c.Logprobs)))
	for _, lp := range c.Logprobs {
		e.b = binary.LittleEndian.AppendUint32(e.b, math.Float32bits(lp))
	}
	if s := c.Sampling; s != nil {
		var set byte
		if s.Temperature != nil {
			set |= 1
		}
		if s.TopP != nil {
			set |= 2
		}
		if s.TopK != nil {
			set |= 4
		}
		e.b = append(e.b, set)
		if s.Temperature != nil {
			e.b = binary.LittleEndian.AppendUint64(e.b, math.Float64bits(*s.Temperature))
		}
		if s.TopP != nil {
			e.b = binary.LittleEndian.AppendUint64(e.b, math.Float64bits(*s.TopP))
		}
		if s.TopK != nil {
			e.varint(int64(*s.TopK))
		}
	}
	blobs := len(e.b)
	e.blob(c.Request, prevBlobs[0])
	e.blob(c.UpstreamRequest, prevBlobs[1])
	e.blob(c.Response, prevBlobs[2])
	return e.b, len(e.b) - blobs
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: bad %s", errCorrupt, what)
	}
}

func (d *decoder) uvarint(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint(what string) int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) length(what string, unit int) int {
	n := d.uvarint(what)
	if d.err == nil && n > uint64(len(d.b)/unit) {
		d.fail(what)
		return 0
	}
	return int(n)
}

func (d *decoder) bytes(what string) []byte {
	n := d.length(what, 1)
	if d.err != nil {
		return nil
	}
	p := d.b[:n:n]
	d.b = d.b[n:]
	return p
}

func (d *decoder) byte1(what string) byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) == 0 {
		d.fail(what)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

// appendTokens decodes a token list onto dst.
func (d *decoder) appendTokens(dst []int32, what string) []int32 {
	n := d.length(what, 1)
	for i := 0; i < n && d.err == nil; i++ {
		v := d.varint(what)
		if v < math.MinInt32 || v > math.MaxInt32 {
			d.fail(what)
		}
		dst = append(dst, int32(v))
	}
	return dst
}

func (d *decoder) time(what string) time.Time {
	p := d.bytes(what)
	if d.err != nil || len(p) == 0 {
		return time.Time{}
	}
	var t time.Time
	if err := t.UnmarshalBinary(p); err != nil {
		d.fail(what)
	}
	return t
}

func (d *decoder) blob(prev []byte, what string) []byte {
	switch d.byte1(what) {
	case 0:
		return nil
	case 1:
		return append([]byte{}, d.bytes(what)...)
	case 2:
		p, s := d.uvarint(what), d.uvarint(what)
		mid := d.bytes(what)
		if d.err != nil || p+s > uint64(len(prev)) {
			d.fail(what)
			return nil
		}
		out := make([]byte, 0, int(p)+len(mid)+int(s))
		out = append(out, prev[:p]...)
		out = append(out, mid...)
		return append(out, prev[len(prev)-int(s):]...)
	default:
		d.fail(what)
		return nil
	}
}

// decodeCall decodes the call stored at seq. fulls holds the full sequence (prompt ++
// response) of every earlier seq of the session; prevBlobs the JSON fields of seq-1, and
// it is updated to this call's. The returned call's PromptIDs and ResponseIDs are
// capacity-limited views of one new array, which is also returned as the call's full
// sequence.
func decodeCall(v []byte, session string, seq int, fulls [][]int32, prevBlobs *[3][]byte) (trace.Call, []int32, error) {
	d := decoder{b: v}
	c := trace.Call{SessionID: session}
	c.Index = int(d.varint("index"))
	c.Choice = int(d.varint("choice"))
	c.PolicyVersion = d.varint("policy version")
	flags := d.byte1("flags")
	c.Trainable = flags&1 != 0
	c.FinishReason = string(d.bytes("finish reason"))
	c.UntrainableReason = string(d.bytes("untrainable reason"))
	c.API = string(d.bytes("api"))
	c.Started = d.time("started")
	c.Finished = d.time("finished")
	c.UpstreamLatency = time.Duration(d.varint("upstream latency"))
	ref := int(d.uvarint("prompt ref")) - 1
	shared := int(d.uvarint("prompt shared"))
	var full []int32
	if d.err == nil {
		switch {
		case ref >= seq || (ref < 0 && shared != 0):
			d.fail("prompt ref")
		case ref >= 0 && shared > len(fulls[ref]):
			d.fail("prompt shared length")
		case ref >= 0:
			full = append(make([]int32, 0, shared+64), fulls[ref][:shared]...)
		}
	}
	full = d.appendTokens(full, "prompt tail")
	np := len(full)
	full = d.appendTokens(full, "response ids")
	if nl := d.length("logprobs", 4); d.err == nil {
		c.Logprobs = make([]float32, nl)
		for i := range c.Logprobs {
			c.Logprobs[i] = math.Float32frombits(binary.LittleEndian.Uint32(d.b[4*i:]))
		}
		d.b = d.b[4*nl:]
		if nl == 0 {
			c.Logprobs = nil
		}
	}
	if flags&2 != 0 {
		c.Sampling = d.sampling()
	}
	for i, what := range [3]string{"request", "upstream request", "response"} {
		prevBlobs[i] = d.blob(prevBlobs[i], what)
	}
	c.Request, c.UpstreamRequest, c.Response = prevBlobs[0], prevBlobs[1], prevBlobs[2]
	if d.err == nil && len(d.b) != 0 {
		d.fail("trailing bytes")
	}
	if d.err != nil {
		return trace.Call{}, nil, fmt.Errorf("session %q call seq %d: %w", session, seq, d.err)
	}
	if np > 0 {
		c.PromptIDs = full[:np:np]
	}
	if len(full) > np {
		c.ResponseIDs = full[np:len(full):len(full)]
	}
	return c, full, nil
}

// callSizes reads a stored call's prompt length and how many of its bytes are the
// recorded JSON (request, upstream request, answer), without decoding its tokens.
func callSizes(v []byte) (promptLen, blobBytes int, err error) {
	d := decoder{b: v}
	d.varint("index")
	d.varint("choice")
	d.varint("policy version")
	flags := d.byte1("flags")
	d.bytes("finish reason")
	d.bytes("untrainable reason")
	d.bytes("api")
	d.time("started")
	d.time("finished")
	d.varint("upstream latency")
	d.uvarint("prompt ref")
	shared := d.uvarint("shared prefix")
	tail := d.skipTokens("prompt tail")
	d.skipTokens("response")
	d.b = d.b[min(len(d.b), 4*d.length("logprobs", 4)):]
	if flags&2 != 0 {
		d.sampling()
	}
	if d.err != nil {
		return 0, 0, d.err
	}
	return int(shared) + tail, len(d.b), nil
}

// skipTokens steps over a token list and returns its length.
func (d *decoder) skipTokens(what string) int {
	n := d.length(what, 1)
	for i := 0; i < n && d.err == nil; i++ {
		d.varint(what)
	}
	return n
}

// float64 reads one little-endian float64.
func (d *decoder) float64(what string) float64 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 8 {
		d.fail(what)
		return 0
	}
	v := math.Float64frombits(binary.LittleEndian.Uint64(d.b))
	d.b = d.b[8:]
	return v
}

// sampling reads the sampling parameters written after the logprobs (flag bit 1).
func (d *decoder) sampling() *trace.Sampling {
	set := d.byte1("sampling")
	if d.err == nil && set&^7 != 0 {
		d.fail("sampling fields")
	}
	s := &trace.Sampling{}
	if set&1 != 0 {
		t := d.float64("sampling temperature")
		s.Temperature = &t
	}
	if set&2 != 0 {
		p := d.float64("sampling top_p")
		s.TopP = &p
	}
	if set&4 != 0 {
		k := int(d.varint("sampling top_k"))
		s.TopK = &k
	}
	if d.err != nil {
		return nil
	}
	return s
}
