package corpus

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"

	"github.com/floe-rl/floe/trace"
)

// events are what the generator counts while it plays sessions: Measure cannot tell a
// compaction from a drift, or see tool output lengths, by looking at the calls alone.
type events struct {
	Compactions         int
	Drifts              int
	StrippedReasoning   int
	SubAgentRuns        int
	SubAgentCalls       int
	Retries             int
	MultiChoiceRequests int
	Untrainable         int
	ToolOutputTokens    []int
}

func (e *events) add(o *events) {
	e.Compactions += o.Compactions
	e.Drifts += o.Drifts
	e.StrippedReasoning += o.StrippedReasoning
	e.SubAgentRuns += o.SubAgentRuns
	e.SubAgentCalls += o.SubAgentCalls
	e.Retries += o.Retries
	e.MultiChoiceRequests += o.MultiChoiceRequests
	e.Untrainable += o.Untrainable
	e.ToolOutputTokens = append(e.ToolOutputTokens, o.ToolOutputTokens...)
}

// Generate returns cfg.Groups groups, the same for the same (cfg, seed). Each group draws
// from its own PCG stream derived from (seed, group index), so the first k groups do not
// depend on cfg.Groups and groups can be built in parallel.
func Generate(cfg Config, seed int64) ([]trace.Group, error) {
	groups, _, err := generate(cfg, seed)
	return groups, err
}

// GenerateWithStats is Generate plus the statistics of the result, including the events
// only the generator can count (Stats.Events).
func GenerateWithStats(cfg Config, seed int64) ([]trace.Group, Stats, error) {
	groups, ev, err := generate(cfg, seed)
	if err != nil {
		return nil, Stats{}, err
	}
	st := Measure(groups)
	st.Events = ev.public()
	return groups, st, nil
}

func generate(cfg Config, seed int64) ([]trace.Group, *events, error) {
	if err := cfg.Validate(); err != nil {
		return nil, nil, err
	}
	groups := make([]trace.Group, cfg.Groups)
	evs := make([]events, cfg.Groups)
	errs := make([]error, cfg.Groups)

	workers := min(runtime.GOMAXPROCS(0), cfg.Groups)
	work := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			var b buffers
			for gi := range work {
				groups[gi], errs[gi] = genGroup(&cfg, seed, gi, &evs[gi], &b)
			}
		})
	}
	for gi := range cfg.Groups {
		work <- gi
	}
	close(work)
	wg.Wait()

	total := &events{}
	for gi := range groups {
		if errs[gi] != nil {
			return nil, nil, fmt.Errorf("corpus: seed %d: %w", seed, errs[gi])
		}
		total.add(&evs[gi])
	}
	return groups, total, nil
}

// buffers are the scratch histories a worker reuses from session to session.
type buffers struct{ ctx, spare, sub []int32 }

func genGroup(cfg *Config, seed int64, gi int, ev *events, b *buffers) (trace.Group, error) {
	// Odd multiplier: distinct group indices give distinct, well-spread streams.
	rng := rand.New(rand.NewPCG(uint64(seed), 0x9e3779b97f4a7c15*uint64(gi+1)))
	voc := vocab{rng: rng, size: cfg.VocabSize}
	smp := &sampler{cfg: cfg, rng: rng, voc: voc}
	prompts := &groupPrompts{
		system:   appendTurn(nil, tokSystem, voc.appendText(nil, cfg.SystemPrefixTokens.sample(rng))),
		task:     appendTurn(nil, tokUser, voc.appendText(nil, cfg.TaskPromptTokens.sample(rng))),
		subAgent: appendTurn(nil, tokSystem, voc.appendText(nil, cfg.SubAgentPrefixTokens.sample(rng))),
	}
	g := trace.Group{
		ID:       fmt.Sprintf("g%03d", gi),
		TaskID:   fmt.Sprintf("swe-task-%03d", gi),
		Sessions: make([]trace.Session, cfg.GroupSize),
	}
	for si := range g.Sessions {
		status, reward := outcome(cfg, rng)
		s := &sessionGen{
			sampler: smp,
			g:       prompts,
			ev:      ev,
			id:      fmt.Sprintf("%s-s%02d", g.ID, si),
			version: int64(rng.IntN(cfg.PolicyVersions)),
			ctx:     b.ctx, spare: b.spare, sub: b.sub,
		}
		if err := s.run(cfg.CallsPerSession.sample(rng), status == trace.StatusTimeout); err != nil {
			return g, fmt.Errorf("group %s: %w", g.ID, err)
		}
		b.ctx, b.spare, b.sub = s.ctx, s.spare, s.sub
		g.Sessions[si] = trace.Session{
			ID:      s.id,
			TaskID:  g.TaskID,
			GroupID: g.ID,
			Calls:   s.calls,
			Reward:  reward,
			Status:  status,
		}
	}
	if err := g.Validate(); err != nil {
		return g, fmt.Errorf("generated an invalid group: %w", err)
	}
	return g, nil
}

// outcome draws how a session ended: SWE-style rewards are mostly pass/fail with some
// partial credit (a fraction of the tests passing); failed and timed-out runs score 0.
func outcome(cfg *Config, rng *rand.Rand) (trace.Status, float64) {
	switch u := rng.Float64(); {
	case u < cfg.FailedProb:
		return trace.StatusFailed, 0
	case u < cfg.FailedProb+cfg.TimeoutProb:
		return trace.StatusTimeout, 0
	}
	switch u := rng.Float64(); {
	case u < 0.45:
		return trace.StatusCompleted, 1
	case u < 0.65:
		return trace.StatusCompleted, float64(1+rng.IntN(3)) / 4
	}
	return trace.StatusCompleted, 0
}
