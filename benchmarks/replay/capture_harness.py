"""Capture a real harness CLI's context — its system messages and tool schemas — from the
first request it made in a harness test run, for `floe-bench replay -harness-prompt`.

    .venv/bin/python -m pytest harness/tests -q -c harness/pytest.ini \
        -k "test_claude_code_reads_file or (test_pi and openai-completions)" --basetemp=/tmp/cap
    .venv/bin/python benchmarks/replay/capture_harness.py /tmp/cap/harness0/calls.jsonl \
        benchmarks/replay/testdata/harness

The request is the one floe forwarded upstream (OpenAI Chat, as every dialect normalizes
to). The test's question becomes {{TASK}}, the test's working directory /testbed (where
the rollouts ran), its HOME /root and the repository's node_modules a global install, so
the capture names nothing of the machine it was taken on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

QUESTION = (
    "Read the file notes.txt in the current directory and tell me the launch code it contains. "
    "Answer with the code only."
)
# api recorded by floe -> (capture name, npm package)
HARNESSES = {
    "anthropic": ("claude-code", "@anthropic-ai/claude-code"),
    "openai_chat": ("pi", "@mariozechner/pi-coding-agent"),
}
REPO = Path(__file__).resolve().parents[2]


def anonymize(text: str) -> str:
    text = re.sub(r"/[^\s\"'`]*/harness\d+/([\w.-]+)-\d+/work", "/testbed", text)
    text = re.sub(r"/[^\s\"'`]*/harness\d+/([\w.-]+)-\d+/home", "/root", text)
    text = re.sub(r"-[\w.-]*-harness\d+-[\w.-]+-\d+-work", "-testbed", text)
    return text.replace(str(REPO / "harness" / "node_modules"), "/usr/lib/node_modules")


def version(package: str) -> str:
    meta = json.loads((REPO / "harness" / "node_modules" / package / "package.json").read_text())
    return str(meta["version"])


def capture(call: dict[str, Any], name: str, package: str) -> dict[str, Any]:
    req = call["upstream_request"]
    messages = []
    for m in req["messages"]:
        content = m["content"]
        if not isinstance(content, str):
            raise SystemExit(f"{name}: a {m['role']} message with content parts; expected text")
        if QUESTION in content:
            content = content.replace(QUESTION, "{{TASK}}")
        messages.append({"role": m["role"], "content": anonymize(content)})
    if not any("{{TASK}}" in m["content"] for m in messages):
        raise SystemExit(f"{name}: the test's question is in no message of the first request")
    return {
        "cli": name,
        "package": package,
        "version": version(package),
        "captured_from": (
            f"the first request of harness/tests ({call['api']} dialect) as floe forwarded it upstream"
        ),
        "messages": messages,
        "tools": json.loads(anonymize(json.dumps(req.get("tools") or [], ensure_ascii=False))),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "calls", type=Path, help="calls.jsonl that floe proxy -record wrote in the harness test run"
    )
    ap.add_argument("out", type=Path, help="folder for <cli>.json")
    args = ap.parse_args(argv)
    done: set[str] = set()
    for line in args.calls.read_text().splitlines():
        call = json.loads(line)
        if call["index"] != 0 or call["api"] not in HARNESSES:
            continue
        name, package = HARNESSES[call["api"]]
        if name in done:
            continue
        done.add(name)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(capture(call, name, package), indent=1, ensure_ascii=False) + "\n")
        print(path)
    missing = {n for n, _ in HARNESSES.values()} - done
    if missing:
        print(f"no first request of: {sorted(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
