"""The demo's rollout driver: GRPO groups of coding-agent sessions through floe's proxy.

Each session is a small agent loop on the official ``openai`` SDK (Chat Completions,
streaming for every other session) with two tools, ``list_dir`` and ``read_file``, over a
throw-away repository this module writes. The model's outputs are scripted on the reference
inference server (``POST /script``) so the run is deterministic: every session's task ends
with a tag unique to it (``[g03s2]``), and each of its scripted outputs matches on that tag,
so concurrent sessions never take each other's outputs, while the sessions of a group still
share their whole prompt up to the tag. The tools really run; the reward is 1 when the final
answer holds the value the repository really has, 0 otherwise (one or two sessions of a
group read a misleading file and answer wrong, so the group's rewards differ).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

GROUP_SIZE = 4
MODEL = "floe-ref"
SYSTEM = (
    "You are a coding agent working inside a software repository. Use the tools to look at "
    "the files you need, then reply with one short sentence that states the answer."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List the entries of a directory of the repository (directories end with /).",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "directory, relative to the repo root"}
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "file, relative to the repo root"}},
                "required": ["path"],
            },
        },
    },
]

# --- the repository --------------------------------------------------------------------

REPO_FILES = {
    "README.md": (
        "# acme-widgets\n\nA small HTTP service that stores widgets.\n\n"
        "The server logs at level info. Works with Python 3.8 and newer.\n"
        "See docs/deploy.md for deployment and CHANGELOG.md for the history.\n"
    ),
    "CHANGELOG.md": (
        "# Changelog\n\n## Unreleased\n- faster widget listing\n\n## 2.3.1\n- fix retry loop\n"
        "- maintainer: Sam Ortiz\n\n## 2.3.0\n- health endpoint\n"
    ),
    "pyproject.toml": (
        '[project]\nname = "acme-widgets"\nversion = "2.4.0"\nrequires-python = ">=3.10"\n'
        'authors = [{name = "Dana Li"}]\ndependencies = ["httpx"]\n'
    ),
    "docs/deploy.md": (
        "# Deploying\n\nBehind the load balancer the service is reached on port 8080.\n"
        "Upstream calls are retried three times (3) by the balancer.\n"
        "The balancer probes /status every 10 s.\n"
    ),
    "src/acme/__init__.py": '"""acme widgets."""\n',
    "src/acme/config.py": (
        '"""Runtime settings."""\n\nDEFAULT_PORT = 8421\nMAX_RETRIES = 5\nTIMEOUT_S = 45\n'
    ),
    "src/acme/server.py": (
        "import logging\n\nfrom .config import DEFAULT_PORT\n\nLOG_LEVEL = \"warning\"\n"
        "HEALTH_PATH = \"/healthz\"\n\n\ndef serve(port: int = DEFAULT_PORT) -> None:\n"
        "    logging.basicConfig(level=LOG_LEVEL.upper())\n"
    ),
    "tests/test_config.py": (
        "from acme import config\n\n\ndef test_timeout():\n    assert config.TIMEOUT_S > 30\n"
    ),
}


@dataclass(frozen=True)
class Task:
    question: str
    file: str  # where the true answer is
    answer: str
    decoy: str  # a file with a misleading value
    wrong: str
    sentence: str  # "{}" is the value


TASKS = [
    Task("Which port does the acme service listen on by default?", "src/acme/config.py", "8421",
         "docs/deploy.md", "8080", "The service listens on port {} by default."),
    Task("What is the package version of acme-widgets?", "pyproject.toml", "2.4.0",
         "CHANGELOG.md", "2.3.1", "The package version is {}."),
    Task("How many times does acme retry a failed upstream call?", "src/acme/config.py", "5",
         "docs/deploy.md", "3", "It retries a failed upstream call {} times."),
    Task("Which log level does the acme server use?", "src/acme/server.py", "warning",
         "README.md", "info", "The server logs at level {}."),
    Task("What is the request timeout of acme, in seconds?", "src/acme/config.py", "45",
         "tests/test_config.py", "30", "The request timeout is {} seconds."),
    Task("Which Python version does acme-widgets require at least?", "pyproject.toml", "3.10",
         "README.md", "3.8", "It requires Python {} or newer."),
    Task("What is the path of the acme health check endpoint?", "src/acme/server.py", "/healthz",
         "docs/deploy.md", "/status", "The health check endpoint is {}."),
    Task("Who is the author of acme-widgets?", "pyproject.toml", "Dana Li",
         "CHANGELOG.md", "Sam Ortiz", "The author is {}."),
]


def write_repo(root: str) -> None:
    for rel, text in REPO_FILES.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def run_tool(root: str, name: str, args: dict[str, Any]) -> str:
    rel = str(args.get("path", "."))
    path = os.path.realpath(os.path.join(root, rel))
    if path != os.path.realpath(root) and not path.startswith(os.path.realpath(root) + os.sep):
        return f"error: {rel} is outside the repository"
    try:
        if name == "list_dir":
            return "\n".join(
                e + ("/" if os.path.isdir(os.path.join(path, e)) else "") for e in sorted(os.listdir(path))
            )
        if name == "read_file":
            with open(path, encoding="utf-8") as f:
                return f.read()
    except OSError as e:
        return f"error: {e.strerror}: {rel}"
    return f"error: unknown tool {name}"


# --- scripts ---------------------------------------------------------------------------


def _call(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "arguments": {"path": path}}


def plan(task: Task, g: int, s: int) -> tuple[list[dict[str, Any]], bool]:
    """The scripted model outputs of session s of group g (3 to 5 calls), and whether it
    ends with the right answer."""
    d = os.path.dirname(task.file) or "."
    variant = (g + s) % GROUP_SIZE
    wrong = variant == 2 or (variant == 1 and g % 3 == 2)  # 1 or 2 wrong answers per group
    if variant == 0:  # explore, then read the right file: 4 calls
        steps = [[_call("list_dir", ".")], [_call("list_dir", d)], [_call("read_file", task.file)]]
    elif variant == 1:  # straight to it: 3 calls
        steps = [[_call("list_dir", ".")], [_call("read_file", task.decoy if wrong else task.file)]]
    elif variant == 2:  # reads the decoy and trusts it: 4 calls
        steps = [
            [_call("list_dir", ".")],
            [_call("read_file", "README.md")],
            [_call("read_file", task.decoy)],
        ]
    else:  # two tools at once, then more: 5 calls
        steps = [
            [_call("list_dir", "."), _call("read_file", "README.md")],
            [_call("list_dir", d)],
            [_call("read_file", task.decoy)],
            [_call("read_file", task.file)],
        ]
    outputs: list[dict[str, Any]] = [{"content": "", "tool_calls": calls} for calls in steps]
    outputs.append({"content": task.sentence.format(task.wrong if wrong else task.answer)})
    return outputs, not wrong


# --- HTTP helpers ------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read() or b"{}")
        return out


def get_json(url: str, timeout: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


# --- the agent loop -----------------------------------------------------------------------


@dataclass
class SessionResult:
    group: int
    index: int
    session_id: str
    calls: int
    reward: float
    status: str
    answer: str = ""
    error: str = ""


@dataclass
class Progress:
    sessions_total: int
    groups_total: int
    sessions_done: int = 0
    groups_done: int = 0
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _complete(client: Any, messages: list[dict[str, Any]], stream: bool) -> tuple[str, list[dict[str, Any]]]:
    """One model call; returns (content, tool_calls as Chat Completions message entries)."""
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=256)
        msg = r.choices[0].message
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in msg.tool_calls or []
        ]
        return msg.content or "", calls
    content: list[str] = []
    acc: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=256, stream=True
    ):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            a = acc.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.id:
                a["id"] = tc.id
            if tc.function is not None:
                a["function"]["name"] += tc.function.name or ""
                a["function"]["arguments"] += tc.function.arguments or ""
    return "".join(content), [acc[k] for k in sorted(acc)]


def run_session(
    control: str, refserver: str, repo: str, task: Task, g: int, s: int, progress: Progress
) -> SessionResult:
    import openai

    sess = post_json(
        f"{control}/floe/v1/sessions",
        {"task_id": f"task-{g:02d}", "group_id": f"group-{g:02d}", "group_size": GROUP_SIZE},
    )
    sid = sess["session_id"]
    tag = f"[g{g:02d}s{s}]"
    outputs, _ = plan(task, g, s)
    for o in outputs:
        o["match"] = {"contains": tag}
    post_json(f"{refserver}/script", {"outputs": outputs})

    client = openai.OpenAI(
        base_url=sess["base_urls"]["openai"], api_key=sess["api_key"], max_retries=0, timeout=60
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{task.question}\n\nTicket {tag}"},
    ]
    stream = s % 2 == 1
    calls, answer, error, status = 0, "", "", "completed"
    try:
        for _ in range(8):
            content, tool_calls = _complete(client, messages, stream)
            calls += 1
            with progress.lock:
                progress.calls += 1
            if not tool_calls:
                answer = content
                break
            messages.append({"role": "assistant", "content": content or None, "tool_calls": tool_calls})
            for tc in tool_calls:
                try:
                    args = json.loads(tc["function"]["arguments"] or "{}")
                except ValueError:
                    args = {}
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": tc["id"],
                        "content": run_tool(repo, tc["function"]["name"], args),
                    }
                )
        else:
            status = "timeout"
    except Exception as e:  # a failed call fails the session; floe keeps it with no loss
        error, status = f"{type(e).__name__}: {e}", "failed"
    reward = 1.0 if status == "completed" and task.answer in answer else 0.0
    post_json(f"{control}/floe/v1/sessions/{sid}/finish", {"reward": reward, "status": status})
    with progress.lock:
        progress.sessions_done += 1
    return SessionResult(g, s, sid, calls, reward, status, answer, error)


def run_group(
    control: str, refserver: str, repo: str, g: int, progress: Progress, pool: ThreadPoolExecutor
) -> list[SessionResult]:
    task = TASKS[g % len(TASKS)]
    futs = [
        pool.submit(run_session, control, refserver, repo, task, g, s, progress) for s in range(GROUP_SIZE)
    ]
    results = [f.result() for f in futs]
    with progress.lock:
        progress.groups_done += 1
    return results


def drive(
    control: str,
    refserver: str,
    repo: str,
    groups: int,
    progress: Progress,
    stop: threading.Event,
    wave: int = 2,
) -> list[SessionResult]:
    """Run ``groups`` groups in waves of ``wave`` groups (floe's groups per step), the
    sessions of a wave concurrently, each on its own thread; the next wave starts when this
    one is done, so each step holds the groups of one wave whatever the thread timing.
    Stops starting waves once ``stop`` is set."""
    write_repo(repo)
    results: list[SessionResult] = []
    with ThreadPoolExecutor(GROUP_SIZE * wave, thread_name_prefix="session") as sessions, \
            ThreadPoolExecutor(wave, thread_name_prefix="group") as grp:
        for first in range(0, groups, wave):
            if stop.is_set():
                break
            futs = [grp.submit(run_group, control, refserver, repo, g, progress, sessions)
                    for g in range(first, min(first + wave, groups))]
            for f in futs:
                results.extend(f.result())
    return results
