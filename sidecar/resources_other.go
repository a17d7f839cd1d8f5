//go:build !unix

package sidecar

import "errors"

func nofileLimit() uint64 { return 0 }

func diskFree(string) (uint64, error) {
	return 0, errors.New("free disk space is not measured on this platform")
}
