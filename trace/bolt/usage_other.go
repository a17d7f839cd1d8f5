//go:build !unix

package bolt

import "io/fs"

func diskBytes(fi fs.FileInfo) int64 { return fi.Size() }
