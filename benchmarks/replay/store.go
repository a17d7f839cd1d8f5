package replay

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// LoadGroups reads every group a floe recorded into its data dir, sorted by ID.
func LoadGroups(dir string) ([]trace.Group, error) {
	st, err := bolt.New(dir, bolt.Options{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", dir, err)
	}
	defer func() { _ = st.Close() }() // read only: a Close error loses nothing
	gs, err := st.Groups()
	if err != nil {
		return nil, fmt.Errorf("listing groups: %w", err)
	}
	out := make([]trace.Group, 0, len(gs))
	for _, gst := range gs {
		g, err := st.Group(gst.ID)
		if err != nil {
			return nil, fmt.Errorf("group %s: %w", gst.ID, err)
		}
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b trace.Group) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// SameRecording reports whether two recordings of the same sessions hold the same token
// ids and log-probs, call for call, and the same rewards; sessions are matched within
// their group by content, not by the IDs floe gave them.
func SameRecording(a, b []trace.Group) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d groups against %d", len(a), len(b))
	}
	for i := range a {
		if a[i].ID != b[i].ID {
			return fmt.Errorf("group %s against %s", a[i].ID, b[i].ID)
		}
		fa, fb := fingerprints(&a[i]), fingerprints(&b[i])
		if !slices.Equal(fa, fb) {
			return fmt.Errorf("group %s: the sessions' calls differ", a[i].ID)
		}
	}
	return nil
}

// fingerprints hashes each session of g (its reward, its calls' tokens, log-probs and
// trainability) and sorts them.
func fingerprints(g *trace.Group) []ctxHash {
	out := make([]ctxHash, 0, len(g.Sessions))
	for _, s := range g.Sessions {
		h := ctxHash{}.push(int32(math.Float32bits(float32(s.Reward))))
		for _, c := range s.Calls {
			h = h.push(int32(len(c.PromptIDs)))
			for _, id := range c.PromptIDs {
				h = h.push(id)
			}
			h = h.push(int32(len(c.ResponseIDs)))
			for k, id := range c.ResponseIDs {
				h = h.push(id).push(int32(math.Float32bits(c.Logprobs[k])))
			}
			if c.Trainable {
				h = h.push(1)
			}
		}
		out = append(out, h)
	}
	slices.SortFunc(out, func(x, y ctxHash) int {
		if c := cmp.Compare(x.a, y.a); c != 0 {
			return c
		}
		return cmp.Compare(x.b, y.b)
	})
	return out
}
