package replay

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/floe-rl/floe/batcher"
)

// Result is one file replayed under one harness-prompt variant.
type Result struct {
	File     string       `json:"file"`
	Agent    string       `json:"agent,omitempty"`
	Harness  string       `json:"harness_prompt"` // "none", or the CLI and its version
	Dialects []string     `json:"dialects"`       // the first was measured; the others recorded the same tokens
	M        *Measurement `json:"-"`
}

// Summary is the one JSON line a file's replay prints on stdout.
type Summary struct {
	File             string           `json:"file"`
	Harness          string           `json:"harness_prompt"`
	Calls            int              `json:"calls"`
	Sessions         int              `json:"sessions"`
	Groups           int              `json:"groups"`
	PerRequestTokens int64            `json:"per_request_tokens"`
	Budget           int              `json:"budget"`
	DP               int              `json:"dp"`
	Rows             map[string]int64 `json:"rows"`
	Passes           map[string]int   `json:"passes"`
	LossTermsEqual   bool             `json:"loss_terms_equal"`
}

// Summary is r's summary line at the headline setting (B 64k, dp 8); a strategy that
// could not form the step there is absent from rows and passes.
func (r Result) Summary() Summary {
	s := Summary{File: filepath.Base(r.File), Harness: r.Harness, Calls: r.M.Calls, Sessions: r.M.Sessions, Groups: r.M.Groups,
		PerRequestTokens: r.M.InputTokens, Budget: Headline.Budget, DP: Headline.DP,
		Rows: map[string]int64{}, Passes: map[string]int{}, LossTermsEqual: r.M.LossTermsEqual()}
	for _, st := range batcher.Strategies {
		if c, ok := r.M.Cell(st, Headline); ok && c.Skipped == "" {
			s.Rows[string(st)], s.Passes[string(st)] = c.PaddedRows, c.Passes
		}
	}
	return s
}

// JSON is the summary as one line.
func (s Summary) JSON() string {
	raw, _ := json.Marshal(s)
	return string(raw)
}

// Markdown renders the results: a headline table (rows per strategy at B 64k, dp 8, each
// file with and without its harness's context), then every setting per file.
func Markdown(results []Result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "## Rows forwarded at B = %s, dp = %d\n\n", kib(Headline.Budget), Headline.DP)
	b.WriteString("Rows are what the trainer forwards, padding included; the ratio is per_request's rows over the strategy's.\n\n")
	b.WriteString("| file | harness prompt | calls | sessions | groups | per_request tokens | per_request rows | prefix_merging rows | tree rows | prefix_merging vs per_request | tree vs per_request | tree vs prefix_merging | tree / cut floor | loss terms equal |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range results {
		pr, _ := r.M.Cell(batcher.PerRequest, Headline)
		pm, _ := r.M.Cell(batcher.PrefixMerging, Headline)
		tr, _ := r.M.Cell(batcher.Tree, Headline)
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			filepath.Base(r.File), r.Harness, r.M.Calls, r.M.Sessions, r.M.Groups, num(r.M.InputTokens),
			rows(pr), rows(pm), rows(tr), ratio(pr, pm), ratio(pr, tr), ratio(pm, tr), floorRatio(tr), yes(r.M.LossTermsEqual()))
	}
	lockstep(&b, results)
	for _, r := range results {
		fmt.Fprintf(&b, "\n## %s, harness prompt %s\n\n", filepath.Base(r.File), r.Harness)
		m := r.M
		fmt.Fprintf(&b, "%d calls (%d trainable) in %d sessions, %d groups; per_request tokens (Σ prompt + response) %s; longest call %s tokens; %s loss terms. ",
			m.Calls, m.TrainableCalls, m.Sessions, m.Groups, num(m.InputTokens), num(int64(m.LongestPath)), num(m.PerRequestTerms))
		fmt.Fprintf(&b, "Replayed through floe's proxy in the %s dialect", strings.Join(r.Dialects, " and "))
		if len(r.Dialects) > 1 {
			b.WriteString(" (both recorded the same token ids and log-probs, call for call)")
		}
		b.WriteString(". Reconstruction: ")
		for i, st := range batcher.Strategies {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "%s %.1f ms", st, 1000*m.ReconstructSeconds[st])
		}
		b.WriteString(".\n\n")
		b.WriteString("| B | dp | strategy | rows forwarded | vs per_request | passes per rank | micro-batches | fill | imbalance | lockstep imbalance | rows / cut floor | cut floor | pack ms | loss terms = per_request |\n")
		b.WriteString("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		sets := settingsOf(m)
		for _, set := range sets {
			pr, _ := m.Cell(batcher.PerRequest, set)
			for _, st := range batcher.Strategies {
				c, _ := m.Cell(st, set)
				if c.Skipped != "" {
					fmt.Fprintf(&b, "| %s | %d | %s | n/a: %s (%s tokens) | | | | | | | | | | |\n", kib(set.Budget), set.DP, st, c.Skipped, num(int64(m.LongestPath)))
					continue
				}
				eq := yes(c.LossTermsEqual)
				if !c.LossTermsEqual {
					eq += ": " + c.LossTermsDiff
				}
				fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %d | %d | %.1f%% | %.3f | %.3f | %.3f | %s | %.2f | %s |\n",
					kib(set.Budget), set.DP, st, num(c.PaddedRows), ratio(pr, c), c.Passes, c.MicroBatches, 100*c.Fill,
					c.Imbalance, c.LockstepImbalance, float64(c.Rows)/float64(c.CutFloor), num(c.CutFloor), 1000*c.PackSeconds, eq)
			}
		}
	}
	return b.String()
}

// lockstep renders the tree strategy's balance at dp > 1: passes per rank, rank imbalance
// and lockstep imbalance per file and setting.
func lockstep(b *strings.Builder, results []Result) {
	var dps []int
	for _, r := range results {
		for _, set := range settingsOf(r.M) {
			if set.DP > 1 && !slices.Contains(dps, set.DP) {
				dps = append(dps, set.DP)
			}
		}
	}
	if len(dps) == 0 {
		return
	}
	slices.Sort(dps)
	fmt.Fprintf(b, "\n## Lockstep balance of the tree strategy at dp %s\n\n", joinInts(dps))
	b.WriteString("Imbalance is the heaviest rank's cost over the mean; lockstep imbalance is Σ_k max_r cost(rank r's micro-batch k) over Σ_k mean_r, ")
	b.WriteString("how much longer ranks running micro-batch k together take than even ones (cost = rows + Σ(depth+1)/16384, padding included). ")
	b.WriteString("With one micro-batch per rank both are the heaviest micro-batch over the mean: a step of a few sessions cannot fill 8 or 16 ranks evenly.\n\n")
	b.WriteString("| file | harness prompt | B | dp | passes per rank | micro-batches | fill | imbalance | lockstep imbalance |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range results {
		for _, set := range settingsOf(r.M) {
			if set.DP < 2 {
				continue
			}
			c, _ := r.M.Cell(batcher.Tree, set)
			if c.Skipped != "" {
				fmt.Fprintf(b, "| %s | %s | %s | %d | n/a: %s | | | | |\n", filepath.Base(r.File), r.Harness, kib(set.Budget), set.DP, c.Skipped)
				continue
			}
			fmt.Fprintf(b, "| %s | %s | %s | %d | %d | %d | %.1f%% | %.3f | %.3f |\n", filepath.Base(r.File), r.Harness,
				kib(set.Budget), set.DP, c.Passes, c.MicroBatches, 100*c.Fill, c.Imbalance, c.LockstepImbalance)
		}
	}
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, " and ")
}

func settingsOf(m *Measurement) []Setting {
	var out []Setting
	for _, c := range m.Cells {
		if !slices.Contains(out, c.Setting) {
			out = append(out, c.Setting)
		}
	}
	return out
}

func rows(c Cell) string {
	if c.Skipped != "" || c.PaddedRows == 0 {
		return "n/a"
	}
	return num(c.PaddedRows)
}

func ratio(base, c Cell) string {
	if base.Skipped != "" || c.Skipped != "" || c.PaddedRows == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2fx", float64(base.PaddedRows)/float64(c.PaddedRows))
}

func floorRatio(c Cell) string {
	if c.Skipped != "" || c.CutFloor == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.3f", float64(c.Rows)/float64(c.CutFloor))
}

func yes(ok bool) string {
	if ok {
		return "yes"
	}
	return "**NO**"
}

func kib(n int) string { return fmt.Sprintf("%dk", n/1024) }

// num writes n with thousands separators.
func num(n int64) string {
	s := fmt.Sprint(n)
	var b strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
			b.WriteByte(',')
		}
		b.WriteRune(r)
	}
	return b.String()
}
