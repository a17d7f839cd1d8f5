package proxy

import (
	"context"

	"time"
)

// Engine is an inference server as the proxy uses it.
type Engine interface {
	// Complete sends a non-streaming request and returns the answer with its token data.
	Complete(ctx context.Context, req *ChatRequest) (*Result, error)
	// Stream sends a streaming request, handing choice 0's deltas to sink as they arrive,
	// and returns the whole answer once the upstream stream ends. An error from the sink
	// (the caller went away) cancels the upstream request.
	Stream(ctx context.Context, req *ChatRequest, sink StreamSink) (*Result, error)
	// CountTokens returns the prompt length of req as the upstream's tokenizer sees it.
	CountTokens(ctx context.Context, req *ChatRequest) (int, error)
	// Models lists the served models.
	Models(ctx context.Context) ([]string, error)
}

// StreamSink receives a streamed answer.
type StreamSink interface {
	Delta(d Delta) error
	// Flush is called whenever no more upstream data is at hand: events written since the
	// last flush go to the caller now. Deltas that arrive together leave together.
	Flush()
}

// TokenData is what training needs of one choice.
type TokenData struct {
	ResponseIDs []int32
	Logprobs    []float32
	// Problem says why the token data cannot be trained on ("" when it can).
	Problem string
}

// Result is an upstream answer: what the caller sees and what floe records.
type Result struct {
	Response  Response
	PromptIDs []int32
	Choices   []TokenData // per choice, by index
	Upstream  []byte      // the request body sent upstream
	Latency   time.Duration
}
