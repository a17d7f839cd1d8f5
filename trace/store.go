package trace

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"time"
)

// The store contract. A store plays one or more roles; each consumer asks only for the
// roles it uses (the proxy records calls and resolves keys, the control API manages
// sessions, the step former reads groups and saves steps). trace/bolt is the durable
// store floe serve runs on; trace/mem holds the same in memory (tests, floe proxy);
// trace/jsonl appends recorded calls to a file and reads them back. trace/tracetest is
// the conformance suite every implementation of a role passes.
//
// Errors: every method wraps one of the sentinel errors below where the case it names
// applies, so callers test with errors.Is and never compare strings; other errors (I/O,
// a corrupt record) are the store's own and mean the store cannot serve the call.

var (
	// ErrUnknownSession: no session with that id (or key).
	ErrUnknownSession = errors.New("unknown session")
	// ErrSessionExists: CreateSession with an id already in the store.
	ErrSessionExists = errors.New("session already exists")
	// ErrSessionFinished: the session was already finished; it takes no calls and no
	// second finish.
	ErrSessionFinished = errors.New("session already finished")
	// ErrUnknownGroup: no group with that id.
	ErrUnknownGroup = errors.New("unknown group")
	// ErrGroupSize: a group's size was already set to another value; the first one
	// given is kept.
	ErrGroupSize = errors.New("group size already set")
	// ErrUnknownStep: CommitStep of a step never saved.
	ErrUnknownStep = errors.New("unknown step")
	// ErrStepConflict: SaveStep of a step number already saved with other groups, or of
	// a group already in another step.
	ErrStepConflict = errors.New("step conflicts with a saved step")
	// ErrCommitted: the step was committed already (exactly once, across restarts).
	ErrCommitted = errors.New("step already committed")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("store closed")
	// ErrReadOnly is returned by every write to a store opened read-only.
	ErrReadOnly = errors.New("store opened read-only")
)

// CallRecorder stores recorded calls.
type CallRecorder interface {
	// Record assigns c its call index within its session (a call with Choice > 0 takes
	// the index of the choice-0 call before it) and stores it. It returns once the call
	// is durable, before the harness sees the answer. ErrUnknownSession or
	// ErrSessionFinished when the session takes no calls (stores that know sessions).
	Record(ctx context.Context, c *Call) error
}

// SessionKeys maps the API key a harness presents to the session it belongs to. Only a
// key given to CreateSession (or Open) resolves: a session's id is never a key.
type SessionKeys interface {
	// Resolve returns the session of key (its ID, TaskID, GroupID, Status and Reward; no
	// calls), so that the proxy can refuse a finished session's key before any upstream
	// call: the session takes calls while its Status is StatusRunning (Session.Running).
	// ErrUnknownSession when the key is unknown; other errors mean the store cannot
	// answer.
	Resolve(key string) (Session, error)
	// Open creates a session for an unknown key (open sessions only) and returns it;
	// a known key returns its session.
	Open(key string) (session string, err error)
}

// SessionStore creates and finishes sessions.
type SessionStore interface {
	// CreateSession stores s (its ID, TaskID and GroupID) as running, with key as its
	// API key. ErrSessionExists when the id is taken. A positive groupSize sets the
	// group's size in the same write; when the group already has another size it fails
	// with ErrGroupSize and creates nothing, so a refused session never holds its group
	// open.
	CreateSession(s Session, key string, groupSize int) error
	// SetGroupSize records how many sessions complete group id; the first size given
	// is kept, and another one fails with ErrGroupSize.
	SetGroupSize(group string, size int) error
	// FinishSession records a running session's outcome. ErrUnknownSession,
	// ErrSessionFinished.
	FinishSession(id string, reward float64, status Status) error
	// Session returns session id with its calls. ErrUnknownSession.
	Session(id string) (Session, error)
}

// GroupStore reads groups and ends them.
type GroupStore interface {
	// Groups lists every group's state, by id.
	Groups() ([]GroupState, error)
	// Group returns group id with its sessions (in creation order) and their calls.
	// ErrUnknownGroup.
	Group(id string) (Group, error)
	// GroupState is group id's bookkeeping, as Groups lists it, without reading the
	// other groups. ErrUnknownGroup.
	GroupState(id string) (GroupState, error)
	// SessionGroupState is GroupState of session id's group. ErrUnknownSession.
	SessionGroupState(id string) (GroupState, error)
	// DropGroup marks group id dropped, with the reason: it never goes into a step.
	// ErrUnknownGroup.
	DropGroup(id, reason string) error
	// TimeOutGroup ends group id at the group timeout: in one write the group is marked
	// timed out and its running sessions finish as timeout with reward 0. It returns the
	// sessions it finished. ErrUnknownGroup.
	TimeOutGroup(id string) ([]string, error)
}

// StepStore records the steps formed and committed.
type StepStore interface {
	// SaveStepRecord records step rec.N with its groups (in order), durable when it
	// returns. Saving the same record again is a no-op; another record under the same
	// number, or a group already in another step, fails with ErrStepConflict; a
	// committed step with ErrCommitted.
	SaveStepRecord(rec StepRecord) error
	// CommitStep records that the trainer consumed step n, exactly once: ErrCommitted on
	// a second commit (also after a restart), ErrUnknownStep for a step never saved.
	CommitStep(n int64) error
	// Steps returns the saved steps not yet committed, by number, and the highest
	// committed step number (-1 when none).
	Steps() (uncommitted []StepRecord, lastCommitted int64, err error)
}

// PolicyVersions keeps the policy version rollouts run under, across restarts.
type PolicyVersions interface {
	SetPolicyVersion(v int64) error
	// PolicyVersion is the last version set; 0 when none.
	PolicyVersion() (int64, error)
}

// The archive's roles (docs/archive.md). A committed step leaves the store for the
// archive in three durable moves, each of which a crash may interrupt and a restart
// finishes: its files are written and the step marked so (MarkStepFilesWritten), its
// groups are forgotten one write each (ForgetStepGroup), and last the step shrinks to a
// tombstone that keeps it committed (ForgetStep). A dropped group leaves in one write
// (ForgetDroppedGroup). A forgotten group's or session's id stays taken: creating a
// session with it, or in it, is refused (ErrSessionExists for a session id), so that a
// reused group never trains twice.

// GroupReader reads a group's sessions, and then each session's calls one at a time, so
// that a group or a session of any size is never in memory whole.
type GroupReader interface {
	// GroupSessions returns group id with its sessions in creation order, without their
	// calls, and their times by session id. ErrUnknownGroup.
	GroupSessions(id string) (Group, map[string]SessionTimes, error)
	// EachCall calls fn with each call of session id in recording order, and stops at
	// fn's first error, which it returns. fn must not keep c. ErrUnknownSession.
	EachCall(id string, fn func(c *Call) error) error
}

// StepArchive hands committed steps to the archive and forgets them once archived.
type StepArchive interface {
	// ArchivableSteps lists the committed steps not yet forgotten, by number.
	ArchivableSteps() ([]int64, error)
	// CommittedStepHead returns committed step n's record, when it was committed and
	// whether its files were written, without its groups' data (GroupReader reads them).
	// ErrUnknownStep; an error for a step not committed or forgotten already.
	CommittedStepHead(n int64) (StepContents, error)
	// MarkStepFilesWritten records, durable, that committed step n's archive files are
	// complete: from then on its groups may be forgotten, and the step is not written
	// again. Marking it again is a no-op. ErrUnknownStep; an error for a step not
	// committed.
	MarkStepFilesWritten(n int64) error
	// ForgetStepGroup removes group id of step n, marked files-written, with its
	// sessions, their calls and keys, in one durable write; a group forgotten already is
	// a no-op. ErrUnknownStep; an error for a step not marked or a group not its own.
	ForgetStepGroup(n int64, id string) error
	// ForgetStep marks committed step n files-written, forgets the groups it has left
	// (ForgetStepGroup) and keeps the step as a committed tombstone: it is no longer
	// archivable, and still takes no second commit or save. Forgetting it again, or
	// after a crash part way, finishes what is left. ErrUnknownStep; an error for a step
	// not committed.
	ForgetStep(n int64) error
}

// DroppedArchive hands the dropped groups (GroupState.Dropped, in no step) to the
// archive and forgets them once archived.
type DroppedArchive interface {
	// DroppedGroup returns dropped group id with its sessions (without their calls),
	// their times, the reason it was dropped and its number among the groups dropped.
	// ErrUnknownGroup; an error for a group not dropped.
	DroppedGroup(id string) (Dropped, error)
	// ForgetDroppedGroup removes dropped group id with its sessions, their calls and
	// keys, in one durable write. A group unknown (forgotten already) is a no-op; a group
	// not dropped is refused.
	ForgetDroppedGroup(id string) error
}

// Compactor gives back the space forgetting freed, when Retention says it pays.
type Compactor interface {
	// CompactIfWorth compacts the store when p says it is worth it for the store's file
	// and the size a compacted one would take, measured with the data in use or
	// liveFloor when more (the archiver passes the largest of its recent passes, so
	// that a store whose in-flight data swings is not compacted at every swing only to
	// grow back). The Compaction says the live bytes also when it does not compact.
	CompactIfWorth(p CompactPolicy, liveFloor int64) (Compaction, error)
}

// Tombstones says where the sessions that left the store for the archive went, so that
// a request for one can name its archive partition.
type Tombstones interface {
	// ForgottenSession says whether session id was archived and forgotten, and where
	// it went; ok is false for an id the store never forgot (unknown, or still live).
	ForgottenSession(id string) (f Forgotten, ok bool, err error)
}

// ArchiveStore is the store the archiver moves committed steps and dropped groups out
// of: GroupStore lists the dropped groups.
type ArchiveStore interface {
	GroupStore
	GroupReader
	StepArchive
	DroppedArchive
	Compactor
}

// Forgotten is where a session went when it left the store: into committed step Step's
// archive partition, or (Dropped) into its dropped group's, DropSeq numbering the drop.
// Known is false for a session forgotten before floe kept where.
type Forgotten struct {
	Known   bool
	Step    int64
	Dropped bool
	DropSeq uint64
}

// SessionTimes are when a session was created and finished (zero while running).
type SessionTimes struct {
	Created, Finished time.Time
}

// StepContents is a committed step's record and how far its archiving got.
type StepContents struct {
	Record      StepRecord
	CommittedAt time.Time
	// FilesWritten: the step's archive files are complete; what is left is to forget it.
	FilesWritten bool
}

// Dropped is a group dropped before any step, with everything the archive keeps of it.
type Dropped struct {
	Group  Group // its sessions without their calls (GroupReader.EachCall reads them)
	Reason string
	// Seq numbers it among the groups the store dropped, from 1 (0: dropped by a floe
	// that did not number them); it names the group's archive partition.
	Seq   uint64
	Times map[string]SessionTimes // by session id
}

// GroupState is a group's bookkeeping, without calls.
type GroupState struct {
	ID         string `json:"id"`
	TaskID     string `json:"task_id"`
	Size       int    `json:"size"`     // 0 when never set
	Sessions   int    `json:"sessions"` // sessions created in the group
	Finished   int    `json:"finished"` // of which finished
	Step       int64  `json:"step"`     // the step the group is in, -1 while in none
	Dropped    bool   `json:"dropped"`
	DropReason string `json:"drop_reason,omitempty"`
	// Created is when the group's first session was created; TimedOut whether the group
	// was ended by the group timeout.
	Created  time.Time `json:"created"`
	TimedOut bool      `json:"timed_out"`
}

// Complete reports whether the group is ready to be formed into a step: every session
// finished, at least Size sessions (unless it timed out), not dropped, in no step yet.
func (g GroupState) Complete() bool {
	return g.Sessions > 0 && g.Finished == g.Sessions && (g.TimedOut || g.Sessions >= g.Size) && !g.Dropped && g.Step < 0
}

// StepRecord is a saved step: its number, the groups it was formed from in order, and
// what the step decided when it was formed. A restart forms an uncommitted step again
// from these decisions, byte for byte as it was served, and the archive says what a
// committed step trained on from them: both replay the record, neither re-derives it
// from the settings floe happens to run with.
type StepRecord struct {
	N      int64    `json:"n"`
	Groups []string `json:"groups"`
	// MinPolicyVersion is the staleness cut-off the step was formed with: calls sampled by
	// an older policy were not trained on. 0: none.
	MinPolicyVersion int64 `json:"min_policy_version"`
	// TokenBudget is the budget the step was packed with; 0 in records written before
	// floe kept it (the fixed budget then applies).
	TokenBudget int `json:"token_budget"`
	// Decisions are how the step was formed and what it trained on; nil in a record an
	// older floe wrote, which floe serve decides once, at its first start on the store
	// (docs/trace.md, "bolt's format and upgrades").
	Decisions *StepDecisions `json:"decisions,omitempty"`
	Committed bool           `json:"committed"`
	Saved     time.Time      `json:"saved"`
}

// StepDecisions are what a step decided when it was formed: the batcher settings it was
// packed with and, for every session of its groups, the advantage it trained with and
// which of its calls it trained on.
type StepDecisions struct {
	// Strategy, Advantage, PadMultiple and PassCost are the batcher's (batcher.Config)
	// when the step was formed: a re-formed step is packed with them, whatever the flags
	// of the restart. The number of data-parallel ranks is not the step's: it is the
	// trainer's, which a restart may change.
	Strategy    string  `json:"strategy"`
	Advantage   string  `json:"advantage"`
	PadMultiple int     `json:"pad_multiple"`
	PassCost    float64 `json:"pass_cost"`
	// Sessions are every session of the step's groups, in the step's group order and each
	// group's creation order, including those the step left out.
	Sessions []SessionDecision `json:"sessions"`
}

// SessionDecision is what a step decided for one session of its groups.
type SessionDecision struct {
	ID string `json:"id"`
	// LeftOut: the session was left out of its group (-drop-failed on a failed or
	// timed-out session): it is in no baseline, has no advantage, and trained no call.
	LeftOut bool `json:"left_out,omitempty"`
	// Advantage is the advantage the step trained the session with, within its group
	// (0 for a failed session, which is out of the baseline; 0 when LeftOut).
	Advantage float64 `json:"advantage"`
	// Calls is how many calls the session held; every one was trained on but those in
	// Untrained.
	Calls int `json:"calls"`
	// Untrained are the calls not trained on, in runs of consecutive calls with one
	// reason (recorded untrainable, session failed, stale, ...), in order.
	Untrained []UntrainedCalls `json:"untrained,omitempty"`
}

// UntrainedCalls are Count consecutive calls of a session, from its call First (the
// position in the session's calls, as trace.Session.Calls holds them), that a step did
// not train on, for Reason.
type UntrainedCalls struct {
	First  int    `json:"first"`
	Count  int    `json:"count"`
	Reason string `json:"reason"`
}

// DecideSession is the decision of a step on session s, whose calls are marked as the
// step trains on them (Call.Trainable, Call.UntrainableReason), with advantage adv;
// leftOut when the step left s out of its group (its advantage is then 0, and its calls
// must be marked untrainable).
func DecideSession(s *Session, adv float64, leftOut bool) SessionDecision {
	d := SessionDecision{ID: s.ID, LeftOut: leftOut, Calls: len(s.Calls)}
	if !leftOut {
		d.Advantage = adv
	}
	for i := range s.Calls {
		c := &s.Calls[i]
		if c.Trainable {
			continue
		}
		if n := len(d.Untrained); n > 0 {
			if last := &d.Untrained[n-1]; last.First+last.Count == i && last.Reason == c.UntrainableReason {
				last.Count++
				continue
			}
		}
		d.Untrained = append(d.Untrained, UntrainedCalls{First: i, Count: 1, Reason: c.UntrainableReason})
	}
	return d
}

// Replay marks call i of the session (c) as the step trained on it: untrained, with the
// recorded reason, or trained, which the call must be recorded as. A call the decision
// does not cover, or a trained one recorded untrainable, is an error: the store no longer
// holds what the step was formed from.
func (d *SessionDecision) Replay(i int, c *Call) error {
	if i < 0 || i >= d.Calls {
		return fmt.Errorf("session %q: call %d, and the step decided on %d calls", d.ID, i, d.Calls)
	}
	for _, u := range d.Untrained {
		if i >= u.First && i < u.First+u.Count {
			c.MarkUntrainable(u.Reason)
			return nil
		}
	}
	if !c.Trainable {
		return fmt.Errorf("session %q: call %d trained in the step, and is recorded untrainable (%s)", d.ID, i, c.UntrainableReason)
	}
	return nil
}

// Same reports whether r and o record the same step: the same number, groups, cut-off,
// budget and decisions (whether committed, and when saved, aside).
func (r StepRecord) Same(o StepRecord) bool {
	return r.N == o.N && slices.Equal(r.Groups, o.Groups) && r.MinPolicyVersion == o.MinPolicyVersion &&
		r.TokenBudget == o.TokenBudget && reflect.DeepEqual(r.Decisions, o.Decisions)
}

// Clone is a copy of r that shares no memory with it.
func (r StepRecord) Clone() StepRecord {
	r.Groups = slices.Clone(r.Groups)
	if r.Decisions != nil {
		d := *r.Decisions
		d.Sessions = slices.Clone(d.Sessions)
		for i := range d.Sessions {
			d.Sessions[i].Untrained = slices.Clone(d.Sessions[i].Untrained)
		}
		r.Decisions = &d
	}
	return r
}
