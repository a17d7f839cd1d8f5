// Package cli holds what floe's commands (cmd/floe, cmd/floe-bench) share: the version
// they print and how a subcommand defines and parses its flags.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"
)

// version is stamped at build time: go build -ldflags "-X
// github.com/floe-rl/floe/internal/cli.version=$(git describe --always --dirty)" (make
// build, floe_stack.build_floe). A plain go build leaves it empty.
var version string

// Version is what the binary says it is: the stamped version; else the module version
// of a go install'ed release; else the commit Go recorded (-buildvcs), "+dirty" when the
// tree had changes; else "(devel)".
func Version() string {
	bi, _ := debug.ReadBuildInfo()
	return versionOf(version, bi)
}

func versionOf(stamped string, bi *debug.BuildInfo) string {
	if stamped != "" {
		return stamped
	}
	if bi == nil {
		return "(devel)"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "+dirty"
			}
		}
	}
	if rev == "" {
		return "(devel)"
	}
	return "devel-" + rev[:min(12, len(rev))] + dirty
}

// NewFlagSet is a subcommand's flag set: errors and help go to stderr, the help headed by
// doc (the command's usage line and description) above the flags.
func NewFlagSet(name, doc string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		_, _ = fmt.Fprint(stderr, doc) // nowhere left to report a failed write to the terminal
		fs.PrintDefaults()
	}
	return fs
}

// Parse parses a subcommand's flags. ok is false when the command must stop: on -h,
// after the flag package printed the help, with a nil error (asking for help is not a
// failure); on a bad flag, with the error; on arguments left over, since every
// subcommand takes flags only.
func Parse(fs *flag.FlagSet, args []string) (ok bool, err error) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return false, nil
		}
		return false, err
	}
	if fs.NArg() > 0 {
		return false, fmt.Errorf("%s: unexpected arguments %q (flags only; see %s -h)", fs.Name(), fs.Args(), fs.Name())
	}
	return true, nil
}
