package cli

import (
	"runtime/debug"
	"testing"
)

func TestVersionOf(t *testing.T) {
	vcs := func(rev, modified string) *debug.BuildInfo {
		return &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified},
		}}
	}
	for _, tc := range []struct {
		name    string
		stamped string
		bi      *debug.BuildInfo
		want    string
	}{
		{"stamped wins", "v0.3.0-4-gabc", vcs("0123456789abcdef", "false"), "v0.3.0-4-gabc"},
		{"go install of a release", "", &debug.BuildInfo{Main: debug.Module{Version: "v0.3.0"}}, "v0.3.0"},
		{"vcs commit", "", vcs("0123456789abcdef0123", "false"), "devel-0123456789ab"},
		{"vcs commit, changed tree", "", vcs("0123456789abcdef0123", "true"), "devel-0123456789ab+dirty"},
		{"nothing recorded", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "(devel)"},
		{"no build info", "", nil, "(devel)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := versionOf(tc.stamped, tc.bi); got != tc.want {
				t.Errorf("versionOf = %q, want %q", got, tc.want)
			}
		})
	}
}
