package trace

import (
	"reflect"
	"strings"
	"testing"
)

// TestDecideSessionAndReplay: a session's calls as a step marked them become runs of
// untrained calls with their reason; replaying the decision on the calls as recorded
// marks them again the same way, and refuses calls the decision does not cover.
func TestDecideSessionAndReplay(t *testing.T) {
	call := func(trainable bool, reason string) Call { return Call{Trainable: trainable, UntrainableReason: reason} }
	tests := []struct {
		name      string
		marked    []Call // as the step trains on them
		leftOut   bool
		want      []UntrainedCalls
		recorded  []Call // as the store holds them
		replayErr string
	}{
		{
			name:     "all trained",
			marked:   []Call{call(true, ""), call(true, "")},
			recorded: []Call{call(true, ""), call(true, "")},
		},
		{
			name:     "runs by reason",
			marked:   []Call{call(false, "stale"), call(false, "stale"), call(true, ""), call(false, "no token ids"), call(false, "stale")},
			want:     []UntrainedCalls{{0, 2, "stale"}, {3, 1, "no token ids"}, {4, 1, "stale"}},
			recorded: []Call{call(true, ""), call(true, ""), call(true, ""), call(false, "no token ids"), call(true, "")},
		},
		{
			name:     "left out",
			marked:   []Call{call(false, "session failed"), call(false, "session failed")},
			leftOut:  true,
			want:     []UntrainedCalls{{0, 2, "session failed"}},
			recorded: []Call{call(true, ""), call(true, "")},
		},
		{
			name:      "a trained call recorded untrainable",
			marked:    []Call{call(true, "")},
			recorded:  []Call{call(false, "no token ids")},
			replayErr: "recorded untrainable",
		},
		{
			name:      "a call the step never saw",
			marked:    []Call{call(true, "")},
			recorded:  []Call{call(true, ""), call(true, "")},
			replayErr: "decided on 1 calls",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := DecideSession(&Session{ID: "s", Calls: tt.marked}, 0.5, tt.leftOut)
			if !reflect.DeepEqual(d.Untrained, tt.want) || d.Calls != len(tt.marked) || d.LeftOut != tt.leftOut ||
				(d.Advantage == 0.5) == tt.leftOut {
				t.Fatalf("decision %+v, want untrained %v of %d calls, left out %v", d, tt.want, len(tt.marked), tt.leftOut)
			}
			var err error
			for i := range tt.recorded {
				if err = d.Replay(i, &tt.recorded[i]); err != nil {
					break
				}
			}
			if tt.replayErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.replayErr) {
					t.Fatalf("replay: %v, want an error saying %q", err, tt.replayErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(tt.recorded, tt.marked) {
				t.Fatalf("replayed %+v, want %+v", tt.recorded, tt.marked)
			}
		})
	}
}
