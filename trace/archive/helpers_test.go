package archive

// WriteStep is for the tests alone: floe writes steps group by group (WriteStepGroups,
// WriteStepRows) and never holds one whole in memory.

import (
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/trace"
)

// WriteStep writes step st, held in memory, as WriteStepGroups does.
func WriteStep(root string, st *Step, mem memory.Allocator, at func(Stage)) error {
	return WriteStepGroups(root, StepHead{Record: st.Record, Committed: st.Committed}, func(yield func(*trace.Group, map[string]SessionInfo) error) error {
		for gi := range st.Groups {
			if err := yield(&st.Groups[gi], st.Sessions); err != nil {
				return err
			}
		}
		return nil
	}, mem, WriteOptions{At: at})
}
