"""A harness runner for floe_bridge.verl (``+floe.runner=harness:run`` with this directory on
PYTHONPATH): one coding-agent episode through floe's proxy, rewarded by a check.

The runner gets the session's base URL and API key (floe's proxy, never the control API)
and verl's prompt row; it returns the reward. Replace the loop with your harness: a CLI
started with OPENAI_BASE_URL / OPENAI_API_KEY set (floe_bridge.verl.CommandRunner does
that for a command line), an SDK agent, a SWE-bench container."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from openai import OpenAI

from floe_bridge.verl import HarnessResult, HarnessTask

TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "run a shell command in the task's sandbox",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]


def sandbox(cmd: str) -> str:
    # Stand-in for the task's sandbox: a real runner executes inside the task's container.
    p = subprocess.run(["bash", "-lc", cmd], capture_output=True, text=True, timeout=60)
    return (p.stdout + p.stderr)[-4000:]


def run(task: HarnessTask, max_turns: int = 8) -> HarnessResult:
    client = OpenAI(base_url=task.openai_base_url, api_key=task.api_key)
    messages: list[Any] = list(task.messages)
    for _ in range(max_turns):
        r = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=1024)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            out = sandbox(json.loads(call.function.arguments).get("cmd", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    # The reward is the task's check; verl's reward_model.ground_truth rides in task.row.
    truth = (task.row.get("reward_model") or {}).get("ground_truth", "")
    final = messages[-1].get("content") or ""
    return HarnessResult(reward=1.0 if truth and str(truth) in final else 0.0)
