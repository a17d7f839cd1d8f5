package providers

import (
	"reflect"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/sglang"
	"github.com/floe-rl/floe/proxy/vllm"
)

func TestNewEngine(t *testing.T) {
	tests := []struct {
		kind    string
		want    proxy.Engine
		wantErr string
	}{
		{"vllm", &vllm.Engine{BaseURL: "http://u", Model: "m"}, ""},
		{"sglang", &sglang.Engine{BaseURL: "http://u", Model: "m"}, ""},
		{" SGLang ", &sglang.Engine{BaseURL: "http://u", Model: "m"}, ""},
		{"tgi", nil, `unknown inference engine "tgi": the supported engines are "vllm" and "sglang"`},
		{"", nil, `the supported engines are "vllm" and "sglang"`},
	}
	for _, tt := range tests {
		got, err := NewEngine(tt.kind, "http://u", "m")
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || got != nil {
				t.Errorf("NewEngine(%q) = %v, %v; want an error saying %q", tt.kind, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("NewEngine(%q) = %#v, %v; want %#v", tt.kind, got, err, tt.want)
		}
	}
}
