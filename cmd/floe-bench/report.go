package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/floe-rl/floe/benchmarks/e2e"
	"github.com/floe-rl/floe/internal/cli"
)

const reportUsage = `usage: floe-bench report -dir DIR

Writes DIR/REPORT.md and its plots from the runs floe-bench e2e recorded in DIR/runs,
and prints a one-line summary per strategy.

`

// runReport is floe-bench report: it turns the runs floe-bench e2e wrote under -dir into
// REPORT.md and its plots in the same folder.
func runReport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench report", reportUsage, stderr)
	dir := fs.String("dir", "", "the end-to-end results folder holding runs/<strategy>.json, e.g. benchmarks/results/e2e-cpu (required)")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	if *dir == "" {
		return errors.New("report: -dir is required")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	runs, err := e2e.LoadRuns(*dir)
	if err != nil {
		return fmt.Errorf("report: %w", err)
	}
	if err := e2e.WriteReport(*dir, runs); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	_, _ = fmt.Fprintln(stdout, filepath.Join(*dir, e2e.ReportFile)) // the terminal's copy: a write error there must not fail the run
	for _, s := range e2e.Summarize(runs) {
		_, _ = fmt.Fprintln(stdout, s) // the terminal's copy: a write error there must not fail the run
	}
	return nil
}
