package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/floe-rl/floe/benchmarks/e2e"
)

// runBenchReport is `floe bench report`: it turns the runs `floe bench e2e` wrote under
// -dir into REPORT.md and its plots in the same folder.
func runBenchReport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("floe bench report", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "the end-to-end results folder holding runs/<strategy>.json, e.g. benchmarks/results/e2e-cpu (required)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if *dir == "" {
		return errors.New("bench report: -dir is required")
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench report: unexpected arguments %q", fs.Args())
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	runs, err := e2e.LoadRuns(*dir)
	if err != nil {
		return fmt.Errorf("bench report: %w", err)
	}
	if err := e2e.WriteReport(*dir, runs); err != nil {
		return fmt.Errorf("bench report: %w", err)
	}
	fmt.Fprintln(stdout, filepath.Join(*dir, e2e.ReportFile))
	for _, s := range e2e.Summarize(runs) {
		fmt.Fprintln(stdout, s)
	}
	return nil
}
