"""Shared fixtures: a hand-made tree micro-batch and a random-tree generator."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# torch.compile's kernel cache defaults to one directory per user under /tmp, shared by
# every checkout on the machine: two test runs compiling the same FlexAttention kernel at
# once were seen to break each other's C++ build. Each checkout keeps its own (ignored
# by git, reused across runs).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[2] / ".venv" / "torchinductor-cache")
)

import numpy as np
import pyarrow as pa
import pytest

from floe_bridge import MICRO_BATCH_SCHEMA, MicroBatchMeta

# The hand-made micro-batch (docs/batcher.md "Arrow" rules: DFS pre-order, position_ids = depth,
# pred_idx = parent row, padding rows subtree_end = i+1 / pred_idx = -1):
#
#   row: 0 -> 1 -> 2          shared prompt (no loss)
#                  |-> 3 -> 4         branch A, sample 0 (4 is sampled)
#                  '-> 5 -> 6 -> 7    branch B, sample 1 (6, 7 are sampled)
#   rows 8, 9: padding
HAND_PARENT: list[int] = [-1, 0, 1, 2, 3, 2, 5, 6, -1, -1]
HAND: dict[str, Sequence[float]] = {
    "input_ids":    [101, 102, 103, 201, 202, 301, 302, 303, 0, 0],
    "position_ids": [0, 1, 2, 3, 4, 3, 4, 5, 0, 0],
    "subtree_end":  [8, 8, 8, 5, 5, 8, 8, 8, 9, 10],
    "pred_idx":     HAND_PARENT,
    "loss_mask":    [0, 0, 0, 0, 1, 0, 1, 1, 0, 0],
    "old_logprobs": [0, 0, 0, 0, -0.5, 0, -1.25, -0.125, 0, 0],
    "advantages":   [0, 0, 0, 0, 1.0, 0, -1.0, -1.0, 0, 0],
    "sample_idx":   [-1, -1, -1, -1, 0, -1, 1, 1, -1, -1],
    "temperature":  [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
}
HAND_PADDING = (8, 9)

HAND_META = MicroBatchMeta(
    step=7,
    rank=1,
    micro_batch=0,
    num_micro_batches=2,
    loss_tokens_global=12,
    policy_version_min=3,
    policy_version_max=4,
    strategy="tree",
)


def make_batch(columns: Mapping[str, Sequence[float | None] | np.ndarray],
               metadata: dict[bytes, bytes] | None = None) -> pa.RecordBatch:
    n = len(columns["input_ids"])
    # temperature: 1 (T = 1) on every row unless a test gives it
    arrays = [
        pa.array(columns[f.name] if f.name in columns else [1.0] * n, type=f.type) for f in MICRO_BATCH_SCHEMA
    ]
    schema = MICRO_BATCH_SCHEMA.with_metadata(metadata) if metadata else MICRO_BATCH_SCHEMA
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


@pytest.fixture
def hand_batch() -> pa.RecordBatch:
    return make_batch(HAND, HAND_META.to_metadata())


@dataclass
class RandomTree:
    columns: dict[str, np.ndarray]
    #: ancestors of each row, root first, from the generator's own parent pointers
    ancestors: list[list[int]]
    padding: list[int]


def random_tree(rng: np.random.Generator, n_nodes: int, n_pad: int) -> RandomTree:
    """A random forest of ``n_nodes`` tokens laid out in DFS pre-order, then padding."""
    # Random parents: node i hangs under some earlier node, or starts a new root.
    parent = [-1 if i == 0 or rng.random() < 0.1 else int(rng.integers(0, i)) for i in range(n_nodes)]
    children: list[list[int]] = [[] for _ in range(n_nodes)]
    roots: list[int] = []
    for i, p in enumerate(parent):
        (roots if p < 0 else children[p]).append(i)
    for c in children:
        rng.shuffle(c)  # sibling order is arbitrary; pre-order must not assume node order

    order: list[int] = []  # DFS pre-order of node ids
    stack = list(reversed(roots))
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(children[v]))
    row_of = {v: r for r, v in enumerate(order)}

    size = [1] * n_nodes
    for v in reversed(order):  # children come after parents in pre-order
        if parent[v] >= 0:
            size[parent[v]] += size[v]

    n = n_nodes + n_pad
    depth = np.zeros(n, np.int32)
    end = np.arange(1, n + 1, dtype=np.int32)
    pred = np.full(n, -1, np.int32)
    ancestors: list[list[int]] = []
    for r, v in enumerate(order):
        chain = []
        p = parent[v]
        while p >= 0:
            chain.append(row_of[p])
            p = parent[p]
        ancestors.append(chain[::-1])
        depth[r] = len(chain)
        end[r] = r + size[v]
        pred[r] = -1 if parent[v] < 0 else row_of[parent[v]]
    padding = list(range(n_nodes, n))
    ancestors.extend([] for _ in padding)

    loss = ((pred >= 0) & (rng.random(n) < 0.5)).astype(np.uint8)
    cols: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, 50_000, n).astype(np.int32),
        "position_ids": depth,
        "subtree_end": end,
        "pred_idx": pred,
        "loss_mask": loss,
        "old_logprobs": np.where(loss == 1, -rng.random(n), 0).astype(np.float32),
        "advantages": np.where(loss == 1, 1.0, 0).astype(np.float32),
        "sample_idx": np.where(loss == 1, 0, -1).astype(np.int32),
    }
    cols["input_ids"][padding] = 0
    return RandomTree(cols, ancestors, padding)


@pytest.fixture
def make_random_tree() -> Callable[[np.random.Generator, int, int], RandomTree]:
    return random_tree


# --- a real floe Flight server -------------------------------------------------------

import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from floe_stack import Child, Stack, build_floe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@dataclass
class FloeServer:
    """A running ``floe corpus-serve``: steps formed from the synthetic corpus."""

    location: str
    steps: int
    token: str | None
    groups_path: Path
    proc: Child

    def groups(self) -> list[dict]:  # type: ignore[type-arg]
        """The corpus the steps were formed from, as ``floe corpus-serve -dump-groups`` wrote it."""
        return json.loads(self.groups_path.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def floe_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The floe binary: $FLOE_BIN, or built from this checkout once per test session."""
    try:
        return build_floe(tmp_path_factory.mktemp("bin"), REPO)
    except RuntimeError as e:
        pytest.fail(f"the Flight tests need floe: {e}")


@pytest.fixture
def floe_server(floe_bin: Path, tmp_path: Path) -> Iterator[Callable[..., FloeServer]]:
    """Factory: ``floe_server(strategy="tree", dp_size=2, ...)`` starts ``floe corpus-serve``
    on a free loopback port with those flags (underscores become dashes) and returns once it
    serves. Every server started is stopped at the end of the test."""
    with Stack(tmp_path / "logs") as procs:

        def start(**flags: object) -> FloeServer:
            dump = tmp_path / f"groups-{len(procs.children)}.json"
            args = [str(floe_bin), "corpus-serve", "-flight-addr", "127.0.0.1:0", "-dump-groups", str(dump)]
            for k, v in flags.items():
                args += [f"-{k.replace('_', '-')}", str(v)]
            proc, ready = procs.start_server("floe", args, timeout=60)
            token = flags.get("flight_token")
            tok = None if token is None else str(token)
            return FloeServer(ready["flight"], ready["steps"], tok, dump, proc)

        yield start
