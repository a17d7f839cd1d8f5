package gpu

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// Without cgo (or with it) a Lib whose Init fails gives a working Monitor with zero
// devices; failingLib panics on any later call, so reaching the end proves none.
func TestMonitorFailedInitNeverCallsAgain(t *testing.T) {
	var logs bytes.Buffer
	m := NewMonitor(failingLib{errors.New("driver not loaded")}, MonitorConfig{Host: NoHost{}, Logger: newTestLogger(&logs), Interval: time.Millisecond})
	m.SetTrainerPIDs([]int32{7})
	for i := range 5 {
		m.SampleAt(time.Unix(int64(i), 0))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := m.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if m.DeviceCount() != 0 {
		t.Fatal("devices without a driver")
	}
	if got := strings.Count(logs.String(), "no NVIDIA driver: GPU monitoring off"); got != 1 {
		t.Fatalf("log: %q", logs.String())
	}
	if len(m.Samples()) < 5 {
		t.Fatalf("%d samples", len(m.Samples()))
	}
}

func TestSystemNVMLNeverPanicsWithoutDriver(t *testing.T) {
	m := NewMonitor(SystemNVML(), MonitorConfig{Host: NoHost{}, Logger: newTestLogger(&bytes.Buffer{})})
	_ = m.SampleAt(time.Now())
}

func newTestLogger(buf *bytes.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(buf, nil)) }
