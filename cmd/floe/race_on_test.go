//go:build race

package main

// raceEnabled: the race detector's shadow memory makes the peak resident memory of a
// floe started from this test binary meaningless (TestHostileHarnessIndexMemory).
const raceEnabled = true
