package proxy_test

import (
	"fmt"
	"io"
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
				if c.Sampling.TopK != nil || sent["top_k"] != nil {
					t.Errorf("call %d: top_k %v recorded, %v sent; floe forwards none", i, c.Sampling.TopK, sent["top_k"])
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
