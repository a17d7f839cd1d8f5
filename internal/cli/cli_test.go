package cli

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		args    []string
		ok      bool
		wantErr string
	}{
		{nil, true, ""},
		{[]string{"-n", "3"}, true, ""},
		{[]string{"-h"}, false, ""},
		{[]string{"-nope"}, false, "flag provided but not defined: -nope"},
		{[]string{"-n", "3", "extra"}, false, `floe thing: unexpected arguments ["extra"] (flags only; see floe thing -h)`},
	}
	for _, tt := range tests {
		fs := flag.NewFlagSet("floe thing", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.Int("n", 0, "a number")
		ok, err := Parse(fs, tt.args)
		if ok != tt.ok || (tt.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("Parse(%q) = %v, %v; want %v and an error mentioning %q", tt.args, ok, err, tt.ok, tt.wantErr)
		}
	}
}

func TestVersion(t *testing.T) {
	if Version() == "" {
		t.Error("empty version")
	}
}
