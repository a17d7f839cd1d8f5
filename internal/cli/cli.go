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

// Version is the module version the binary was built from, or "(devel)" for a build
// from a working tree.
func Version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

// NewFlagSet is a subcommand's flag set: errors and help go to stderr, the help headed by
// doc (the command's usage line and description) above the flags.
func NewFlagSet(name, doc string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, doc)
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
