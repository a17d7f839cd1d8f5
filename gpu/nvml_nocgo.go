//go:build !cgo

package gpu

import "errors"

// SystemNVML, in a build without cgo, is a Lib whose Init fails: go-nvml needs cgo, so
// the Monitor runs with zero devices.
func SystemNVML() Lib {
	return failingLib{errors.New("built without cgo: NVML unavailable")}
}
