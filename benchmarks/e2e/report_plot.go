package e2e

import (
	"bytes"
	"fmt"
	"math"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Plot size: 8x4 in at 150 dpi (1200x600 px) stays legible when GitHub scales it down.
const (
	PlotWidth  = 8 * vg.Inch
	PlotHeight = 4 * vg.Inch
	PlotDPI    = 150
)

// figure is a plot whose legend is drawn beside the data area rather than over it, since
// utilization lines fill the whole height and would be hidden under an inset legend.
type figure struct {
	p      *plot.Plot
	legend plot.Legend
}

func newFigure(title, xLabel, yLabel string) *figure {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xLabel
	p.Y.Label.Text = yLabel
	p.Add(plotter.NewGrid())
	l := plot.NewLegend()
	l.Top, l.Left = true, true
	l.Padding = vg.Points(6)
	return &figure{p: p, legend: l}
}

// addSeries draws one strategy's points as a line with markers. Colours and markers follow
// the strategy, not the position in runs, so a strategy looks the same in every plot.
func (f *figure) addSeries(strategy string, xys plotter.XYs, marks bool) error {
	if len(xys) == 0 {
		return nil
	}
	k := max(strategyRank(strategy), 0)
	line, points, err := plotter.NewLinePoints(xys)
	if err != nil {
		return fmt.Errorf("%s: %w", strategy, err)
	}
	line.Color = plotutil.Color(k)
	line.Width = vg.Points(1.5)
	line.Dashes = plotutil.Dashes(k)
	f.p.Add(line)
	if marks {
		points.Color = plotutil.Color(k)
		points.Shape = plotutil.Shape(k)
		points.Radius = vg.Points(2.5)
		f.p.Add(points)
		f.legend.Add(strategy, line, points)
		return nil
	}
	f.legend.Add(strategy, line)
	return nil
}

func (f *figure) png() ([]byte, error) {
	c := vgimg.NewWith(vgimg.UseWH(PlotWidth, PlotHeight), vgimg.UseDPI(PlotDPI))
	dc := draw.New(c)
	r := f.legend.Rectangle(dc)
	gap := vg.Points(10)
	legendWidth := r.Max.X - r.Min.X + gap
	f.p.Draw(draw.Crop(dc, 0, -legendWidth, 0, 0))
	// Start the legend below the title so that it lines up with the data area.
	title := f.p.Title.TextStyle.Height(f.p.Title.Text) + f.p.Title.Padding
	f.legend.Draw(draw.Crop(dc, dc.Max.X-dc.Min.X-legendWidth+gap/2, 0, 0, -title-gap))
	var buf bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(&buf); err != nil {
		return nil, fmt.Errorf("encode png: %w", err)
	}
	return buf.Bytes(), nil
}

func writePlot(path string, runs []Run, build func([]Run) (*figure, error)) error {
	f, err := build(runs)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	data, err := f.png()
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// gpuPlot shows the training window of every run that has GPU samples, aligned on the
// trainer's first step so that the strategies' curves can be compared directly.
func gpuPlot(runs []Run) (*figure, error) {
	f := newFigure("GPU utilization during training", "time since the trainer's first step (s)", "GPU utilization (%)")
	f.p.Y.Min, f.p.Y.Max = 0, 100
	f.p.Y.Tick.Marker = plot.ConstantTicks(percentTicks())
	f.p.X.Min = 0
	for _, r := range runs {
		start, end, ok := r.TrainingWindow()
		if !ok {
			continue
		}
		var xys plotter.XYs
		for _, g := range r.GPU {
			if g.T >= start && g.T <= end {
				xys = append(xys, plotter.XY{X: g.T - start, Y: 100 * g.Utilization})
			}
		}
		if err := f.addSeries(r.Strategy, xys, false); err != nil {
			return nil, err
		}
	}
	return f, nil
}

func percentTicks() []plot.Tick {
	var ts []plot.Tick
	for v := 0; v <= 100; v += 10 {
		t := plot.Tick{Value: float64(v)}
		if v%20 == 0 {
			t.Label = fmt.Sprintf("%d", v)
		}
		ts = append(ts, t)
	}
	return ts
}

func stepSecondsPlot(runs []Run) (*figure, error) {
	f := newFigure("Trainer seconds per step", "training step", "trainer time per step (s)")
	f.p.Y.Min = 0
	f.p.Y.Tick.Marker = compactTicks{}
	return f, addPerStep(f, runs, func(s Step) float64 { return s.StepSeconds })
}

// rowsPlot uses lines rather than grouped bars: a run has tens to hundreds of steps, far
// too many for readable bar groups.
func rowsPlot(runs []Run) (*figure, error) {
	f := newFigure("Rows forwarded per step", "training step", "rows forwarded per step (tokens)")
	f.p.Y.Min = 0
	f.p.Y.Tick.Marker = compactTicks{}
	return f, addPerStep(f, runs, func(s Step) float64 { return float64(s.Rows) })
}

func addPerStep(f *figure, runs []Run, y func(Step) float64) error {
	some := false
	for _, r := range runs {
		xys := make(plotter.XYs, len(r.Steps))
		for i, s := range r.Steps {
			xys[i] = plotter.XY{X: float64(s.Step), Y: y(s)}
		}
		some = some || len(xys) > 0
		if err := f.addSeries(r.Strategy, xys, true); err != nil {
			return err
		}
	}
	if !some {
		// Without data the axes have no range to draw; an empty frame still says "no steps".
		f.p.X.Min, f.p.X.Max, f.p.Y.Max = 0, 1, 1
	}
	return nil
}

// compactTicks labels the default ticks as the tables write numbers (1.2M, 350k).
type compactTicks struct{}

func (compactTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i, t := range ts {
		if t.Label != "" {
			if math.Abs(t.Value) < 1e-12*math.Max(math.Abs(lo), math.Abs(hi)) {
				t.Value = 0
			}
			ts[i].Label = compact(t.Value)
		}
	}
	return ts
}
