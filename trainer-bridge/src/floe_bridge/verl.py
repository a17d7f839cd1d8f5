"""verl integration: a custom agent-loop manager that feeds verl from floe (docs/verl.md).

verl (0.9.1, PyPI ``verl``) takes a custom manager by class path,
``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=floe_bridge.verl.FloeAgentLoopManager``,
and calls its ``generate_sequences(prompts)`` once per batch. This manager, for each prompt
of the batch (its ``n`` rollouts share one ``uid``: verl's GRPO group):

1. opens ``n`` floe sessions in one floe group (control API ``POST /floe/v1/sessions``);
2. runs the user's harness runner once per session, with the session's base URL and API
   key (the harness calls the model through floe's proxy, which records every call's
   token ids and log-probs);
3. finishes each session with the runner's reward and reads back its recorded calls
   (``GET /floe/v1/sessions/{id}``);
4. builds verl's batch from those calls with verl's own ``AgentLoopOutput`` and verl's own
   post-processing (``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``), so
   the ``DataProto`` is laid out exactly as verl's default manager lays it out, and carries
   floe's recorded ids and log-probs (``rollout_log_probs``) unchanged.

:class:`FloeAgentLoop` is the same session as one of verl's agent loops (``agent_name``
``floe_agent``), for verl's own managers: its V1 trainer (0.9.1's default), which takes no
custom manager that returns a batch.

Weight sync: :class:`FloeCheckpointEngineManager` (verl's
``actor_rollout_ref.rollout.checkpoint_manager_class``) pauses floe before verl's
``update_weights(global_steps)`` and resumes it with ``policy_version = global_steps``.

Row layouts (``floe.layout``): ``session`` (default; what verl's trainers expect: one row
per input row, which ``batch.union`` in ``ray_trainer.fit`` requires) merges a session's
calls into one row where each call's prompt extends the previous call's prompt and
response, the tokens between (tool results, the next user turn, the chat template's
markers) masked 0; ``call`` gives one row per call (step-wise, as SkyRL trains), each
carrying its session's reward and the input row's non-tensor fields (``uid`` included).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from verl.checkpoint_engine import CheckpointEngineManager
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    register,
)
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await

__all__ = [
    "CommandRunner",
    "FloeAgentLoop",
    "ControlClient",
    "FloeAgentLoopManager",
    "FloeCheckpointEngineManager",
    "FloeSettings",
    "HarnessResult",
    "HarnessTask",
    "Row",
    "call_rows",
    "session_row",
]

log = logging.getLogger(__name__)

LAYOUTS = ("session", "call")


# --- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloeSettings:
    """The manager's settings: the ``floe`` block of verl's config (``+floe.control_url=...``),
    each key falling back to an environment variable (the checkpoint manager sees no config
    of its own, so the control address can come from the environment for both)."""

    control_url: str = "http://127.0.0.1:8701"
    control_token: str | None = None
    # "module:callable" or a command line (see HarnessTask, CommandRunner).
    runner: str | None = None
    layout: str = "session"
    # Sessions run at once (threads: a runner is usually I/O-bound on the model).
    concurrency: int = 16
    # Give up on one control API request after this long.
    http_timeout: float = 60.0
    # A prefix for floe's group ids. verl's uids (uuid4 per prompt and batch) are unique
    # already; the prefix names the run in floe's records. Every process of the run must
    # see the same one (a group's sessions may be opened by different Ray workers).
    run_id: str = "verl"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig | None) -> FloeSettings:
        raw: dict[str, Any] = {}
        if isinstance(cfg, DictConfig):
            container = OmegaConf.to_container(cfg, resolve=True)
            raw = {str(k): v for k, v in container.items()} if isinstance(container, dict) else {}
        elif cfg is not None:
            raw = dict(cfg)
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"floe: unknown settings {sorted(unknown)}")
        env = os.environ
        token = raw.get("control_token") or env.get("FLOE_CONTROL_TOKEN")
        if token is None and env.get("FLOE_CONTROL_TOKEN_FILE"):
            with open(env["FLOE_CONTROL_TOKEN_FILE"], encoding="utf-8") as f:
                token = f.read().strip()
        out = cls(
            control_url=str(raw.get("control_url") or env.get("FLOE_CONTROL_URL") or cls.control_url),
            control_token=token,
            runner=raw.get("runner") or env.get("FLOE_RUNNER"),
            layout=str(raw.get("layout", "session")),
            concurrency=int(raw.get("concurrency", 16)),
            http_timeout=float(raw.get("http_timeout", 60.0)),
            run_id=str(raw.get("run_id") or env.get("FLOE_RUN_ID") or cls.run_id),
        )
        if out.layout not in LAYOUTS:
            raise ValueError(f"floe.layout {out.layout!r} is not one of {LAYOUTS}")
        if out.concurrency < 1:
            raise ValueError("floe.concurrency must be at least 1")
        return out


# --- control API -----------------------------------------------------------------------------


class ControlError(RuntimeError):
    """A control API call answered with an error (its status and floe's message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"floe control API: {status} {message}")
        self.status = status


class ControlClient:
    """floe's session and control API (docs/control.md), standard library only."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + "/floe/v1" + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", "")
            except (ValueError, AttributeError):
                msg = e.reason
            raise ControlError(e.code, str(msg)) from None
        if not isinstance(out, dict):
            raise ControlError(200, f"{method} {path}: answer is not a JSON object")
        return out

    def create_session(
        self, task_id: str, group_id: str | None, group_size: int | None, metadata: Mapping[str, Any]
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"task_id": task_id, "metadata": dict(metadata)}
        if group_id is not None:
            body["group_id"] = group_id
            body["group_size"] = group_size
        return self._call("POST", "/sessions", body)

    def finish(self, session_id: str, reward: float, status: str = "completed") -> dict[str, Any]:
        return self._call("POST", f"/sessions/{session_id}/finish", {"reward": reward, "status": status})

    def session(self, session_id: str) -> dict[str, Any]:
        return self._call("GET", f"/sessions/{session_id}")

    def pause(self) -> dict[str, Any]:
        return self._call("POST", "/pause", {})

    def resume(self, policy_version: int) -> dict[str, Any]:
        return self._call("POST", "/resume", {"policy_version": int(policy_version)})


# --- the harness runner ----------------------------------------------------------------------


@dataclass(frozen=True)
class HarnessTask:
    """What a harness runner gets for one session. ``base_urls`` and ``api_key`` are the only
    way to the model (floe's proxy); the session id and the control address stay with the
    manager, so nothing the harness runs can change rewards or sessions (docs/security.md)."""

    base_urls: Mapping[str, str]
    api_key: str
    # verl's ``raw_prompt`` for the row: the chat messages of the prompt.
    messages: list[dict[str, Any]]
    # The row's other non-tensor fields (data_source, reward_model, extra_info, uid, ...).
    row: Mapping[str, Any]
    # Which of the group's n rollouts this is (0..n-1).
    rollout: int

    @property
    def openai_base_url(self) -> str:
        return self.base_urls["openai"]


@dataclass(frozen=True)
class HarnessResult:
    """A session's outcome: its reward and floe's status (completed, failed or timeout;
    docs/control.md says what each does to the group's baseline)."""

    reward: float
    status: str = "completed"


Runner = Callable[[HarnessTask], "HarnessResult | float"]


class CommandRunner:
    """Runs a harness command line per session. The command gets the session's addresses in
    its environment (``OPENAI_BASE_URL``/``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``/
    ``ANTHROPIC_API_KEY``, ``FLOE_BASE_URLS`` as JSON) and the task as JSON on stdin
    (``{"messages", "row", "rollout"}``); its last stdout line is the reward, a number or
    ``{"reward": r, "status": s}``. A non-zero exit finishes the session as failed."""

    def __init__(self, argv: Sequence[str] | str, timeout: float | None = None) -> None:
        self.argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
        self.timeout = timeout

    def __call__(self, task: HarnessTask) -> HarnessResult:
        env = dict(os.environ)
        env.update(
            OPENAI_BASE_URL=task.base_urls["openai"],
            OPENAI_API_KEY=task.api_key,
            ANTHROPIC_BASE_URL=task.base_urls.get("anthropic", ""),
            ANTHROPIC_API_KEY=task.api_key,
            FLOE_BASE_URLS=json.dumps(dict(task.base_urls)),
        )
        stdin = json.dumps({"messages": task.messages, "row": _jsonable(task.row), "rollout": task.rollout})
        try:
            p = subprocess.run(
                self.argv, input=stdin, env=env, capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired:
            return HarnessResult(0.0, "timeout")
        lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
        if p.returncode != 0 or not lines:
            log.warning("harness %s exited %d: %s", self.argv[0], p.returncode, p.stderr[-2000:])
            return HarnessResult(0.0, "failed")
        last = json.loads(lines[-1])
        if isinstance(last, dict):
            return HarnessResult(float(last["reward"]), str(last.get("status", "completed")))
        return HarnessResult(float(last))


def load_runner(spec: str | Runner | None) -> Runner:
    """A runner from ``module:callable``, a command line, or a callable."""
    if spec is None:
        raise ValueError("floe.runner is not set: give module:callable or a command line")
    if callable(spec):
        return spec
    mod, sep, name = spec.partition(":")
    if sep and " " not in spec and all(p.isidentifier() for p in mod.split(".") + name.split(".")):
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise TypeError(f"floe.runner {spec!r} is not callable")
        return obj  # type: ignore[no-any-return]
    return CommandRunner(spec)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return [_jsonable(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


# --- rows from recorded calls ----------------------------------------------------------------


@dataclass
class Row:
    """One training row in verl's terms: prompt ids, then the response ids with a mask (1 on
    tokens the model sampled in a trainable call, 0 elsewhere) and the rollout log-prob of
    each response token (0 where the mask is 0)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Indices of the calls the row covers, and of the session's calls it leaves out.
    calls: list[int] = field(default_factory=list)
    left_out: list[int] = field(default_factory=list)
    num_turns: int = 0

    def append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None) -> None:
        self.response_ids.extend(int(t) for t in ids)
        self.response_mask.extend([mask] * len(ids))
        self.logprobs.extend([float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))


def _usable(calls: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], list[int]]:
    """The session's calls a row can be built from, in order: choice 0 of each call (the
    other choices of an n > 1 call are siblings, which one row cannot hold)."""
    keep = [c for c in sorted(calls, key=lambda c: (int(c["index"]), int(c.get("choice", 0))))]
    left = [int(c["index"]) for c in keep if int(c.get("choice", 0)) != 0]
    return [c for c in keep if int(c.get("choice", 0)) == 0], left


def _sampled(c: Mapping[str, Any]) -> tuple[list[int], int, list[float] | None]:
    ids = [int(t) for t in c.get("response_ids") or []]
    lps = c.get("logprobs")
    trainable = bool(c.get("trainable")) and lps is not None and len(lps) == len(ids)
    # An untrainable call's tokens stay as context; its log-probs are absent or unusable.
    return ids, 1 if trainable else 0, [float(x) for x in lps] if trainable and lps is not None else None


def call_rows(calls: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One row per recorded call (step-wise): the call's prompt, its sampled tokens."""
    usable, _ = _usable(calls)
    rows = []
    for c in usable:
        r = Row(prompt_ids=[int(t) for t in c["prompt_ids"]], calls=[int(c["index"])], num_turns=2)
        ids, mask, lps = _sampled(c)
        r.append(ids, mask, lps)
        rows.append(r)
    return rows


def session_row(calls: Sequence[Mapping[str, Any]]) -> Row:
    """One row per session: the first call's prompt, then each call's sampled tokens (mask 1)
    and the tokens between one call's end and the next call's prompt end (mask 0: tool
    results, the next user turn, template markers). A call whose prompt does not extend the
    row so far (the harness rewrote or trimmed its context) cannot share the row: the row
    restarts at it, and the calls before it are left out (``Row.left_out``), since verl's
    trainer takes exactly one row per rollout."""
    usable, left = _usable(calls)
    if not usable:
        raise ValueError("session has no recorded calls")
    # The last chain of calls that extend each other, found from the end back.
    start = len(usable) - 1
    while start > 0:
        prev = usable[start - 1]
        context = [int(t) for t in prev["prompt_ids"]] + [int(t) for t in prev.get("response_ids") or []]
        prompt = usable[start]["prompt_ids"]
        if len(prompt) < len(context) or [int(t) for t in prompt[: len(context)]] != context:
            break
        start -= 1
    first = usable[start]
    row = Row(prompt_ids=[int(t) for t in first["prompt_ids"]], left_out=left)
    row.left_out += [int(c["index"]) for c in usable[:start]]
    context_len = len(row.prompt_ids)
    for c in usable[start:]:
        prompt = c["prompt_ids"]
        row.append([int(t) for t in prompt[context_len:]], 0, None)
        ids, mask, lps = _sampled(c)
        row.append(ids, mask, lps)
        row.calls.append(int(c["index"]))
        context_len = len(prompt) + len(ids)
    row.num_turns = 1 + 2 * len(row.calls)
    return row


# --- the manager -----------------------------------------------------------------------------


@dataclass
class _Session:
    row: int  # the input row
    group: str
    rollout: int
    group_size: int = 1
    session_id: str = ""
    result: HarnessResult | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def run_session(control: ControlClient, runner: Runner, s: _Session, row: Mapping[str, Any]) -> None:
    """One floe session: open it in its group, run the harness with its addresses, finish it
    with the harness's reward, read back the calls floe recorded (into ``s``)."""
    created = control.create_session(
        task_id=str(row.get("uid", s.row)),
        group_id=s.group or None,
        group_size=s.group_size if s.group else None,
        metadata={"verl_row": s.row, "rollout": s.rollout},
    )
    s.session_id = str(created["session_id"])
    messages = _jsonable(row.get("raw_prompt", []))
    task = HarnessTask(base_urls=created["base_urls"], api_key=str(created["api_key"]),
                       messages=list(messages), row=row, rollout=s.rollout)
    t0 = time.monotonic()
    try:
        res = runner(task)
        s.result = res if isinstance(res, HarnessResult) else HarnessResult(float(res))
    except Exception:
        # The session must still finish, or its group never completes in floe.
        log.exception("harness runner failed on session %s", s.session_id)
        s.result = HarnessResult(0.0, "failed")
    s.seconds = time.monotonic() - t0
    s.finish = control.finish(s.session_id, s.result.reward, s.result.status)
    s.calls = list(control.session(s.session_id).get("calls") or [])


def session_outputs(
    s: _Session, layout: str, prompt_length: int, response_length: int
) -> list[AgentLoopOutput]:
    """verl's AgentLoopOutputs of one finished session: one (``session``) or one per call."""
    if not s.calls:
        raise RuntimeError(
            f"floe session {s.session_id} (row {s.row}) recorded no calls: its harness never "
            "reached the model through floe's proxy")
    assert s.result is not None
    rows = [session_row(s.calls)] if layout == "session" else call_rows(s.calls)
    outputs = []
    for r in rows:
        if r.left_out:
            log.warning("floe session %s: calls %s do not extend the row and are left out",
                        s.session_id, r.left_out)
        # verl pads to fixed widths and cannot truncate without breaking the recorded tokens.
        if len(r.prompt_ids) > prompt_length:
            raise ValueError(f"floe session {s.session_id}: prompt of {len(r.prompt_ids)} tokens exceeds "
                             f"actor_rollout_ref.rollout.prompt_length={prompt_length}")
        if len(r.response_ids) > response_length:
            raise ValueError(f"floe session {s.session_id}: response of {len(r.response_ids)} tokens "
                             f"exceeds actor_rollout_ref.rollout.response_length={response_length}")
        # reward_extra_info: verl's V1 worker copies it from a trajectory's last output to
        # the others, and the runner's reward has none.
        extra = {"floe_session_id": s.session_id, "floe_calls": list(r.calls),
                 "floe_calls_left_out": list(r.left_out), "floe_status": s.result.status,
                 "reward_extra_info": {}}
        outputs.append(AgentLoopOutput(
            prompt_ids=r.prompt_ids, response_ids=r.response_ids, response_mask=r.response_mask,
            response_logprobs=r.logprobs, reward_score=s.result.reward, num_turns=r.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=s.seconds / max(len(rows), 1)),
            extra_fields=extra,
        ))
    return outputs


class FloeAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager, fed by floe. verl constructs it with
    ``FloeAgentLoopManager.create(config=..., llm_client=..., teacher_client=...,
    reward_loop_worker_handles=...)`` (``ray_trainer.init_workers``); a test or a custom loop
    may pass ``runner=`` (a callable) and ``settings=`` directly.

    The harness reaches the model only through floe (``floe serve -upstream`` names verl's
    vLLM servers), so ``llm_client`` is not used for generation. The runner gives each
    session's reward (floe needs it to finish the session), so verl's reward loop
    (``reward_loop_worker_handles``) is not called."""

    def __init__(
        self,
        config: DictConfig,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        runner: str | Runner | None = None,
        settings: FloeSettings | None = None,
    ) -> None:
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        self.settings = settings or FloeSettings.from_config(config.get("floe"))
        self.runner = load_runner(runner if runner is not None else self.settings.runner)
        self.control = ControlClient(
            self.settings.control_url, self.settings.control_token, self.settings.http_timeout
        )
        self.n = int(self.rollout_config.n)

    async def _init_agent_loop_workers(self) -> None:
        # No Ray workers: the rows are built in this process by verl's own worker class,
        # whose post-processing (padding, masks, position ids, rm_scores) is what verl's
        # default manager runs. Its llm_client is never called.
        self.agent_loop_workers: list[Any] = []
        # verl annotates the last two as non-optional but defaults them to None (no teacher,
        # no reward loop: the runner gives the rewards).
        self.builder = AgentLoopWorker(self.config, self.llm_client, None, None)  # type: ignore[arg-type]

    @auto_await  # type: ignore[untyped-decorator]
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        t0 = time.monotonic()
        validate = bool(prompts.meta_info.get("validate", False))
        step = int(prompts.meta_info.get("global_steps", -1))
        sessions = self._plan(prompts, step, validate)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=min(self.settings.concurrency, len(sessions))) as pool:
            await asyncio.gather(
                *[loop.run_in_executor(pool, self._run_session, prompts, s) for s in sessions]
            )
        outputs, kwargs_rows, session_of_row = self._outputs(prompts, sessions)
        # verl's own per-row post-processing (padding, masks, position ids, rm_scores), in
        # input order: the trainer unions the output with its input row by row.
        internal = await asyncio.gather(*[
            self.builder._agent_loop_postprocess(o, validate, **kw)
            for o, kw in zip(outputs, kwargs_rows, strict=True)
        ])
        # The input row's non-tensor fields (uid, data_source, reward_model, ...) on each
        # output row: one per input row in the session layout, repeated per call otherwise.
        rows_idx = np.array([sessions[i].row for i in session_of_row], dtype=np.int64)
        input_non_tensor = {k: v[rows_idx] for k, v in prompts.non_tensor_batch.items()}
        out: DataProto = self.builder._postprocess(internal, input_non_tensor_batch=input_non_tensor,
                                                   validate=validate)
        for k, v in input_non_tensor.items():
            out.non_tensor_batch.setdefault(k, v)
        # Which floe session (and call) each row came from, for tracing a row back to floe.
        out.non_tensor_batch["floe_session_id"] = np.array(
            [sessions[i].session_id for i in session_of_row], dtype=object)
        metrics = out.meta_info.pop("metrics")
        timing = self._performance_metrics([metrics], out)
        timing["floe/seconds"] = time.monotonic() - t0
        timing["floe/calls"] = float(sum(len(s.calls) for s in sessions))
        timing["floe/calls_left_out"] = float(
            sum(len(o.extra_fields.get("floe_calls_left_out", [])) for o in outputs))
        out.meta_info = {"timing": timing, **out.meta_info}
        return out

    def _plan(self, prompts: DataProto, step: int, validate: bool) -> list[_Session]:
        """One floe session per input row; rows sharing a uid (verl's n rollouts of one
        prompt) form one floe group, so floe's group and verl's GRPO group are the same."""
        nt = prompts.non_tensor_batch
        # Without verl's uid, the step number keeps one batch's groups apart from the next's.
        uids = ([str(u) for u in nt["uid"]] if "uid" in nt
                else [f"step{step}-{i // self.n}" for i in range(len(prompts))])
        seen: dict[str, int] = {}
        sessions = []
        for i, u in enumerate(uids):
            # Validation rollouts are groups of one: floe records them, and drops them at
            # -min-group-size >= 2 instead of training on them.
            group = "" if validate else f"{self.settings.run_id}-{u}"
            sessions.append(_Session(row=i, group=group, rollout=seen.get(u, 0)))
            seen[u] = seen.get(u, 0) + 1
        for s in sessions:
            s.group_size = seen[uids[s.row]]
        return sessions

    def _run_session(self, prompts: DataProto, s: _Session) -> None:
        run_session(self.control, self.runner, s, {k: v[s.row] for k, v in prompts.non_tensor_batch.items()})

    def _outputs(
        self, prompts: DataProto, sessions: list[_Session]
    ) -> tuple[list[AgentLoopOutput], list[dict[str, Any]], list[int]]:
        outputs: list[AgentLoopOutput] = []
        kwargs_rows: list[dict[str, Any]] = []
        session_of_row: list[int] = []
        pl, rl = int(self.rollout_config.prompt_length), int(self.rollout_config.response_length)
        for k, s in enumerate(sessions):
            kw = {key: v[s.row] for key, v in prompts.non_tensor_batch.items()}
            for o in session_outputs(s, self.settings.layout, pl, rl):
                outputs.append(o)
                kwargs_rows.append(kw)
                session_of_row.append(k)
        return outputs, kwargs_rows, session_of_row


@register("floe_agent")
class FloeAgentLoop(AgentLoopBase):
    """The same floe session as one of verl's agent loops (``agent_name`` ``floe_agent``):
    verl's own manager runs it once per trajectory, in its Ray workers. This is the slot
    verl's V1 trainer (``trainer.use_v1=true``, verl 0.9.1's default) leaves open: V1 builds
    its own ``AgentLoopManagerTQ``, which puts each trajectory's outputs into TransferQueue,
    and calls a custom manager's ``generate_sequences`` expecting it to do the same.

    Each trajectory opens its session in the floe group named by its ``uid`` with
    ``rollout.n`` sessions; with ``floe.layout=call`` it returns one output per call, which
    V1 stores one per key (``{uid}_{session}_{index}``) and the V0 worker refuses (it takes
    one output per trajectory)."""

    # Which of its group's rollouts a trajectory is, where verl does not say (V0 passes the
    # row's fields only): the worker starts a group's trajectories in row order, and each
    # trajectory gets a new instance, so the count lives on the class (one int per uid).
    _started: dict[str, int] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = FloeSettings.from_config(self.config.get("floe"))
        self.runner = load_runner(self.settings.runner)
        self.control = ControlClient(
            self.settings.control_url, self.settings.control_token, self.settings.http_timeout
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        uid = kwargs.get("uid")
        if "session_id" in kwargs:  # V1 numbers the group's trajectories
            rollout = int(kwargs["session_id"])
        else:
            rollout = FloeAgentLoop._started.get(str(uid), 0)
            FloeAgentLoop._started[str(uid)] = rollout + 1
        s = _Session(
            row=-1,
            group=f"{self.settings.run_id}-{uid}" if uid is not None else "",
            rollout=rollout,
            group_size=int(self.rollout_config.n),
        )
        await asyncio.to_thread(run_session, self.control, self.runner, s, kwargs)
        outputs = session_outputs(s, self.settings.layout, int(self.rollout_config.prompt_length),
                                  int(self.rollout_config.response_length))
        return outputs[0] if self.settings.layout == "session" else outputs


class FloeCheckpointEngineManager(CheckpointEngineManager):
    """verl's weight-sync manager with floe's gate around it
    (``actor_rollout_ref.rollout.checkpoint_manager_class``): floe pauses (waits for calls in
    flight, holds new ones) before verl pushes the actor's weights to the rollout replicas,
    and resumes under ``policy_version = global_steps`` after, so every call floe records
    names the verl step whose weights sampled it. The control address comes from
    ``checkpoint_engine.engine_kwargs.floe`` (``control_url``, ``control_token``), else
    ``$FLOE_CONTROL_URL`` / ``$FLOE_CONTROL_TOKEN``."""

    def __init__(self, config: Any, actor_wg: Any, replicas: Any) -> None:
        super().__init__(config, actor_wg, replicas)
        kwargs = getattr(config, "engine_kwargs", None) or {}
        floe = kwargs.get("floe") if isinstance(kwargs, Mapping) else None
        s = FloeSettings.from_config(
            {k: v for k, v in (floe or {}).items() if k in ("control_url", "control_token")})
        self.floe = ControlClient(s.control_url, s.control_token, s.http_timeout)

    @auto_await  # type: ignore[untyped-decorator]
    async def update_weights(self, global_steps: int | None = None) -> Any:
        paused = self.floe.pause()
        try:
            return await CheckpointEngineManager.update_weights.__wrapped__(self, global_steps)
        finally:
            version = int(global_steps) if global_steps is not None else int(paused.get("policy_version", 0))
            self.floe.resume(version)
