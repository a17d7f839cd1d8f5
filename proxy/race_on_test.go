//go:build race

package proxy_test

// raceEnabled: the race detector's shadow memory and slower loops make heap peaks
// meaningless, and the peak-memory test slow.
const raceEnabled = true
