//go:build unix

package sidecar

import (
	"fmt"
	"syscall"
)

// nofileLimit is the process's descriptor limit (RLIMIT_NOFILE's soft limit, which Go
// raises to the hard limit at start); 0 when it cannot be read.
func nofileLimit() uint64 {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0
	}
	return uint64(rl.Cur) //nolint:unconvert // Rlimit.Cur is an int64 on FreeBSD
}

// diskFree is the space an unprivileged process may still write on dir's file system.
func diskFree(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return uint64(st.Bavail) * uint64(st.Bsize), nil //nolint:unconvert // Bavail is an int64 on FreeBSD
}
