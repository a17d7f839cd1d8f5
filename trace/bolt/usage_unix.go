//go:build unix

package bolt

import (
	"io/fs"
	"syscall"
)

// diskBytes is what the file occupies on disk: its blocks, not its length.
func diskBytes(fi fs.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return fi.Size()
}
