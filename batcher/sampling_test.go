package batcher_test

import (
	"testing"

	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Issue 13 item 5: calls whose processed log-probs the trainer cannot reproduce (top_p < 1,
// top_k > 0, greedy) are counted per session in the sample table and in the step's stats.
func TestSampleTableFlagsTruncatedSampling(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	k := func(v int) *int { return &v }
	withSampling := func(c trace.Call, s *trace.Sampling) trace.Call { c.Sampling = s; return c }
	groups := []trace.Group{{ID: "g", TaskID: "t", Sessions: []trace.Session{
		{ID: "a", Reward: 1, Calls: []trace.Call{
			withSampling(call("a", 0, ids(1, 2), ids(3)), &trace.Sampling{Temperature: f(0.7), TopP: f(0.9)}),
			withSampling(call("a", 1, ids(1, 2, 3), ids(4)), &trace.Sampling{Temperature: f(0)}),
			withSampling(call("a", 2, ids(1, 2, 3, 4), ids(5)), &trace.Sampling{Temperature: f(0.7)}),
		}},
		{ID: "b", Reward: 0, Calls: []trace.Call{
			withSampling(call("b", 0, ids(1, 2), ids(6)), &trace.Sampling{TopK: k(20)}),
			withSampling(call("b", 1, ids(1, 2, 6), ids(7)), &trace.Sampling{TopK: k(0), TopP: f(1)}),
			call("b", 2, ids(1, 2, 6, 7), ids(8)),
		}},
	}}}
	st, err := batcher.FormStep(1, groups, testConfig(batcher.Tree))
	if err != nil {
		t.Fatal(err)
	}
	tab := st.SampleTable(memory.DefaultAllocator)
	defer tab.Release()
	col := tab.Column(tab.Schema().FieldIndices("num_truncated_calls")[0]).(*array.Int32).Int32Values()
	if got := []int32{col[0], col[1]}; got[0] != 2 || got[1] != 1 {
		t.Errorf("num_truncated_calls %v, want [2 1]", got)
	}
	if st.Stats.TruncatedCalls != 3 {
		t.Errorf("stats count %d truncated calls, want 3", st.Stats.TruncatedCalls)
	}
}
