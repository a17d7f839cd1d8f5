package proxy_test

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
)

type samplingCounts struct {
	mu        sync.Mutex
	overrides map[string]int
	truncated int
}

func (m *samplingCounts) Recorded(string, bool)          {}
func (m *samplingCounts) Upstream(string, time.Duration) {}
func (m *samplingCounts) Failed(string, proxy.ErrorKind) {}
func (m *samplingCounts) SampledTruncated(string)        { m.mu.Lock(); m.truncated++; m.mu.Unlock() }
func (m *samplingCounts) SamplingOverridden(_, param string) {
	m.mu.Lock()
	m.overrides[param]++
	m.mu.Unlock()
}

// Issue 13 item 5: each call records the sampling parameters sent upstream; under force
// the upstream gets T = 1, top_p = 1 whatever the caller asked, and each override counts.
func TestSamplingIsRecordedAsSentUpstream(t *testing.T) {
	for _, policy := range []proxy.SamplingPolicy{proxy.SamplingRecord, proxy.SamplingForce} {
		t.Run(string(policy), func(t *testing.T) {
			up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
			f := newFixture(t, up)
			m := &samplingCounts{overrides: map[string]int{}}
			f.srv.Sampling, f.srv.Metrics = policy, m
			for _, extra := range []string{`,"temperature":0.7,"top_p":0.9`, `,"temperature":0.7,"stream":true`, ""} {
				resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, extra))
				_, _ = io.ReadAll(resp.Body)
				if resp.StatusCode != 200 {
					t.Fatalf("status %d", resp.StatusCode)
				}
			}
			calls := f.store.Calls("sess-1")
			if len(calls) != 3 || len(up.requests) != 3 {
				t.Fatalf("%d calls, %d upstream requests", len(calls), len(up.requests))
			}
			for i, c := range calls {
				sent := up.requests[i]
				if c.Sampling == nil {
					t.Fatalf("call %d: no sampling recorded", i)
				}
				got := map[string]any{}
				if c.Sampling.Temperature != nil {
					got["temperature"] = *c.Sampling.Temperature
				}
				if c.Sampling.TopP != nil {
					got["top_p"] = *c.Sampling.TopP
				}
				for _, k := range []string{"temperature", "top_p"} {
					if got[k] != sent[k] {
						t.Errorf("call %d: recorded %s %v, sent upstream %v", i, k, got[k], sent[k])
					}
				}
				// Under either policy top_k -1 and min_p 0 keep a model's generation config
				// from truncating behind floe's back (no dialect forwards a caller's).
				if sent["top_k"] != -1.0 || sent["min_p"] != 0.0 {
					t.Errorf("call %d: sent top_k %v min_p %v, want -1 0", i, sent["top_k"], sent["min_p"])
				}
				if c.Sampling.TopK == nil || *c.Sampling.TopK != -1 {
					t.Errorf("call %d: top_k %v recorded, -1 sent", i, c.Sampling.TopK)
				}
			}
			want := map[proxy.SamplingPolicy][3]any{
				proxy.SamplingRecord: {0.7, 0.9, nil},
				proxy.SamplingForce:  {1.0, 1.0, nil},
			}[policy]
			if up.requests[0]["temperature"] != want[0] || up.requests[0]["top_p"] != want[1] {
				t.Errorf("upstream got temperature %v top_p %v, want %v %v", up.requests[0]["temperature"], up.requests[0]["top_p"], want[0], want[1])
			}
			if policy == proxy.SamplingForce {
				if m.overrides["temperature"] != 2 || m.overrides["top_p"] != 1 || up.requests[2]["temperature"] != 1.0 {
					t.Errorf("overrides %v, third request %v", m.overrides, up.requests[2])
				}
				if m.truncated != 0 {
					t.Errorf("%d calls counted truncated under force", m.truncated)
				}
			} else {
				if len(m.overrides) != 0 || up.requests[2]["temperature"] != nil {
					t.Errorf("record overrode %v; third request %v", m.overrides, up.requests[2])
				}
				if m.truncated != 1 || calls[0].Sampling.Reproducible() || !calls[1].Sampling.Reproducible() {
					t.Errorf("truncated calls counted %d, want 1 (top_p 0.9)", m.truncated)
				}
			}
		})
	}
}

// Issues 20 (3.2) and 21 (9): a call whose log-probs come from a distribution the
// trainer cannot reproduce is recorded untrainable with the reason: constrained decoding
// (tool_choice "required" or a named function: vLLM masks the logits with a grammar)
// always; truncated sampling (top_p < 1, greedy) unless -train-truncated. The
// truncated-sampling metric still counts every truncated call; -sampling force samples
// without truncation, so its calls train.
func TestUntrainableSampling(t *testing.T) {
	tools := `,"tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}]`
	cases := []struct {
		name           string
		extra          string
		trainTruncated bool
		policy         proxy.SamplingPolicy
		wantReason     string // "" : trainable
		wantTruncated  int    // calls counted by SampledTruncated
	}{
		{"free sampling trains", `,"temperature":0.7`, false, "", "", 0},
		{"tool_choice auto trains", tools + `,"tool_choice":"auto"`, false, "", "", 0},
		{"tool_choice none trains", tools + `,"tool_choice":"none"`, false, "", "", 0},
		{"top_p 0.9", `,"top_p":0.9`, false, "", "truncated sampling: top_p 0.9 (", 1},
		{"greedy", `,"temperature":0`, false, "", "truncated sampling: greedy decoding (temperature 0) (", 1},
		{"top_p 0.9 with -train-truncated", `,"top_p":0.9`, true, "", "", 1},
		{"greedy with -train-truncated", `,"temperature":0`, true, "", "", 1},
		{"top_p 0.9 under -sampling force", `,"top_p":0.9`, false, proxy.SamplingForce, "", 0},
		{"tool_choice required", tools + `,"tool_choice":"required"`, false, "", `constrained decoding: tool_choice "required" (`, 0},
		{"tool_choice required, -train-truncated does not keep it", tools + `,"tool_choice":"required"`, true, "", `constrained decoding: tool_choice "required" (`, 0},
		{"named function", tools + `,"tool_choice":{"type":"function","function":{"name":"read_file"}}`, false, "",
			`constrained decoding: tool_choice names the function "read_file" (`, 0},
		{"named function under -sampling force", tools + `,"tool_choice":{"type":"function","function":{"name":"read_file"}}`, false, proxy.SamplingForce,
			`constrained decoding: tool_choice names the function "read_file" (`, 0},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
				f := newFixture(t, up)
				m := &samplingCounts{overrides: map[string]int{}}
				f.srv.Sampling, f.srv.TrainTruncated, f.srv.Metrics = tc.policy, tc.trainTruncated, m
				extra := tc.extra
				if stream {
					extra += `,"stream":true`
				}
				resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, extra))
				_, _ = io.ReadAll(resp.Body)
				if resp.StatusCode != 200 {
					t.Fatalf("status %d", resp.StatusCode)
				}
				calls := f.store.Calls("sess-1")
				if len(calls) != 1 {
					t.Fatalf("%d calls recorded", len(calls))
				}
				c := calls[0]
				switch {
				case tc.wantReason == "" && !c.Trainable:
					t.Errorf("untrainable (%s), want trainable", c.UntrainableReason)
				case tc.wantReason != "" && (c.Trainable || !strings.HasPrefix(c.UntrainableReason, tc.wantReason)):
					t.Errorf("trainable %v, reason %q; want untrainable, reason starting %q", c.Trainable, c.UntrainableReason, tc.wantReason)
				}
				if m.truncated != tc.wantTruncated {
					t.Errorf("SampledTruncated counted %d calls, want %d", m.truncated, tc.wantTruncated)
				}
			})
		}
	}
}
