"""The real Pi coding agent (@mariozechner/pi-coding-agent, CLI `pi`) through floe, once per
API kind Pi speaks: anthropic-messages, openai-completions, openai-responses and
google-generative-ai.

Pi takes a custom provider from ~/.pi/agent/models.json ({"providers": {name: {baseUrl,
api, apiKey, models: [{id, ...}]}}}; apiKey names an environment variable or is the key
itself) and runs one prompt non-interactively with `pi -p --provider NAME --model ID
PROMPT`. PI_OFFLINE=1 skips its startup network calls. Its file tool is `read` with
{"path", "offset"?, "limit"?}. In -p mode Pi makes no side calls (no titles, no
summaries): each run is exactly the two scripted calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, QUESTION, Session, Stack, base_env
from scenario import Harness, run_read_task, run_weight_sync

PROVIDER = "floe"
MODEL = "floe-model"
KEY_ENV = "FLOE_API_KEY"
# Pi's API kinds, and the kind floe records their calls under.
APIS = {"anthropic-messages": "anthropic", "openai-completions": "openai_chat",
        "openai-responses": "openai_responses", "google-generative-ai": "gemini"}


def base_url(api: str, s: Session) -> str:
    if api == "anthropic-messages":
        return s.base_urls["anthropic"]  # the Anthropic SDK appends /v1/messages
    if api in ("openai-completions", "openai-responses"):
        return s.base_urls["openai"]  # …/v1: the OpenAI SDK appends /chat/completions, /responses
    # pi-ai's google client sets apiVersion "" when the model has a baseUrl, so the
    # version segment is the baseUrl's: …/v1beta/models/{id}:streamGenerateContent
    return s.base_urls["gemini"] + "/v1beta"


def write_models(home: Path, api: str, s: Session) -> dict[str, Any]:
    """~/.pi/agent/models.json with one provider of this API kind, keyed by $FLOE_API_KEY.
    reasoning: true makes Pi ask for thinking (Anthropic thinking, reasoning_effort,
    Responses reasoning + encrypted_content, Gemini includeThoughts) and echo it back."""
    cfg = {"providers": {PROVIDER: {
        "baseUrl": base_url(api, s), "api": api, "apiKey": KEY_ENV,
        "models": [{"id": MODEL, "reasoning": True, "input": ["text"],
                    "contextWindow": 32768, "maxTokens": 4096}],
    }}}
    d = home / ".pi" / "agent"
    d.mkdir(parents=True)
    (d / "models.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def pi(api: str) -> Harness:
    """Pi with a provider of this API kind."""

    def launch(s: Session, home: Path, work: Path) -> tuple[list[str], dict[str, str]]:
        write_models(home, api, s)
        env = base_env(home) | {KEY_ENV: s.key, "PI_OFFLINE": "1"}
        return [str(BIN / "pi"), "-p", "--provider", PROVIDER, "--model", MODEL, QUESTION], env

    return Harness(name=f"Pi ({api})", exe="pi", task=f"pi-{api}", api=APIS[api], tool="read",
                   read_args=lambda work: {"path": "notes.txt"}, launch=launch)


@pytest.mark.parametrize("api", list(APIS))
def test_pi(stack: Stack, api: str) -> None:
    # The conversation is the two scripted calls (run_read_task checks it is the whole main
    # chain): the read, then the answer, the second's prompt extending the first's prompt +
    # response token for token (reasoning included), then the tool result.
    run_read_task(stack, pi(api))


def test_pi_weight_sync(stack: Stack) -> None:
    # Pausing holds Pi's next call whatever the API kind; one suffices.
    run_weight_sync(stack, pi("openai-completions"))
