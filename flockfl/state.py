"""ServerState and its atomic, checksummed checkpoints.

A checkpoint file is ``MAGIC + sha256(payload) + payload`` where the payload is a
``torch.save`` of the state. It is written to a temp file, fsynced and renamed, so a crash
leaves either the old file or the new one. Loading verifies the checksum; a corrupt or
truncated file is refused and the previous good checkpoint is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from flockfl.errors import CheckpointError
from flockfl.files import atomic_write
from flockfl.clientstate import ClientTable, collect_garbage, flush_all, table_root, tables
from flockfl.engine.runtime import in_background
from flockfl.rowfiles import signature

MAGIC = b"FLOCKFL-CKPT-1\n"
CKPT_RE = re.compile(r"^ckpt-(\d{6})\.pt$")


@dataclass
class DriverRecord:
    """What the round driver (``flockfl/rounds.py``) and the flow keep about the run, beside the
    algorithm's own ``meta`` (which the driver never reads or writes)."""

    engine: Optional[str] = None  # the trainer the run uses (``rounds.pick_engine``; ``ctx.trainer``)
    engine_reason: Optional[str] = None  # "configured", or auto's timings of both trainers
    pre_federation: Optional[dict] = None  # the one-shot step's cost: seconds, bytes_up, bytes_down
    eval_protocol: Optional[dict] = None  # the protocol the run reports under (``eval.*``)
    all_trained_round: Optional[int] = None  # the round after which every federating client had trained
    trained: Optional[np.ndarray] = None  # until then, which of them have (packed bits)
    newcomers: Optional[dict] = None  # how the newcomers joined: clients, clusters, rule, new_clusters
    cycle: int = 0  # the running cycle of a multi-cycle round (FedCluster)
    partial_round: Optional[dict] = None  # a mid-round checkpoint's progress (``rounds.RoundWork``)
    round_cohort: Optional[list] = None  # a stage's cohort of a whole multi-cycle round
    mlflow_run_id: Optional[str] = None  # the MLflow run a resume continues (set by the flow)
    eval_reuse: Optional[dict] = None  # the last evaluation's per-client metrics (``eval.reuse``, flockfl/eval_reuse.py)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "DriverRecord":
        """A checkpoint written before the record existed kept these in ``meta``: moved out of it."""
        return cls(**{f.name: meta.pop(f.name) for f in dataclasses.fields(cls) if f.name in meta})


@dataclass
class ServerState:
    """Everything needed to continue a run.

    ``round`` counts completed rounds. ``models`` holds k stacked models (leading axis =
    cluster; k = 1 for a single global model). ``assignments`` is the last known cluster of
    every client (-1 = never assigned); ``assignment_history`` has one row per round.
    ``algo`` holds algorithm-specific tensors (server optimiser moments, control
    variates, ...). Random streams need no saved state: every draw is a pure function of
    (seed, round, client, purpose), recorded in ``meta['rng']``. ``meta`` is the algorithm's
    (and ``meta['round_log']`` the round's extra history columns); ``driver`` is the driver's.
    """

    round: int
    models: dict[str, torch.Tensor]
    assignments: np.ndarray
    assignment_history: np.ndarray
    algo: dict[str, Any] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    driver: DriverRecord = field(default_factory=DriverRecord)

    def replace(self, **changes: Any) -> "ServerState":
        return dataclasses.replace(self, **changes)

    @property
    def k(self) -> int:
        return next(iter(self.models.values())).shape[0]

    def digest(self) -> str:
        """SHA-256 of the model tensors, algorithm tensors and assignments (bit-exact identity)."""
        h = hashlib.sha256()
        _hash_named(h, self.models)
        for name, t in _tensors(self.algo):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        for name, table in tables(self.algo):  # per-client rows: by their row digests
            h.update(name.encode())
            table.update_hash(h)
        h.update(np.ascontiguousarray(self.assignments, dtype=np.int64).tobytes())
        return h.hexdigest()

    def to_payload(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "models": {k: v.detach().cpu() for k, v in self.models.items()},
            "assignments": torch.from_numpy(np.asarray(self.assignments, np.int64)),
            "assignment_history": torch.from_numpy(np.asarray(self.assignment_history, np.int64)),
            "algo": _to_cpu(self.algo),
            "history": self.history,
            "meta": self.meta,
            "driver": dataclasses.asdict(self.driver),
        }

    @classmethod
    def from_payload(cls, p: dict[str, Any], run_dir: Optional[Path] = None) -> "ServerState":
        meta = dict(p["meta"])
        driver = DriverRecord(**p["driver"]) if "driver" in p else DriverRecord.from_meta(meta)
        return cls(
            int(p["round"]), dict(p["models"]), p["assignments"].numpy(), p["assignment_history"].numpy(),
            _from_cpu(dict(p["algo"]), run_dir), list(p["history"]), meta, driver,
        )


def _tensors(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested dict, with its dotted path, in sorted order."""
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, dict):
        return [item for k in sorted(tree) for item in _tensors(tree[k], f"{prefix}.{k}" if prefix else str(k))]
    return []


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, ClientTable):
        return tree.payload()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    return tree


def _from_cpu(tree: Any, run_dir: Optional[Path], prefix: str = "") -> Any:
    """The inverse of ``_to_cpu``: client tables come back, reading their rows from ``run_dir``."""
    if isinstance(tree, dict) and tree.get("__client_table__"):
        return ClientTable.from_payload(tree, table_root(run_dir, prefix) if run_dir is not None else None)
    if isinstance(tree, dict):
        return {k: _from_cpu(v, run_dir, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    return tree


def encode_state(state: ServerState) -> bytes:
    return encode_payload(state.to_payload())


def encode_payload(payload: dict[str, Any]) -> bytes:
    """A checkpoint's bytes: the header, the payload's checksum, the ``torch.save``'d payload."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    raw = buf.getvalue()
    return MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw


def decode_state(data: bytes, source: str = "checkpoint", run_dir: Optional[Path] = None) -> ServerState:
    """The state in ``data`` (verified); its client tables read their rows under ``run_dir``
    (default: the directory they were written in)."""
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{source}: not a flockfl checkpoint (bad header)")
    head_end = len(MAGIC) + 65
    if len(data) < head_end:
        raise CheckpointError(f"{source}: truncated (header incomplete)")
    digest, payload = data[len(MAGIC) : head_end - 1].decode("ascii", "replace"), data[head_end:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{source}: checksum mismatch (truncated or corrupt)")
    try:
        return ServerState.from_payload(torch.load(io.BytesIO(payload), weights_only=False), run_dir)
    except Exception as err:
        raise CheckpointError(f"{source}: unreadable payload ({type(err).__name__})") from None


def checkpoint_path(run_dir: Path, round: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"ckpt-{round:06d}.pt"


def save_checkpoint(state: ServerState, run_dir: Path, keep: int = 3) -> Path:
    """Atomically write the state for its round and prune all but the newest ``keep``.

    Per-client rows (:class:`~flockfl.clientstate.ClientTable`) are written first, only those
    the state changed since its last checkpoint; the checkpoint file holds their digests. Row
    files that no kept checkpoint refers to any more are then deleted."""
    run_dir = Path(run_dir)
    flush_all(state.algo, run_dir)
    path = checkpoint_path(run_dir, state.round)
    atomic_write(path, encode_state(state), state.round - 1)
    ckpts = list_checkpoints(run_dir)
    pruned, kept = ckpts[:-keep], ckpts[-keep:]
    held = dict(tables(state.algo))
    if held:
        WRITTEN_TABLES.put(path, held)
    pruned_algos = [_algo_of(p, run_dir) for p in pruned] if held else []  # read before they go
    for old in pruned:
        old.unlink(missing_ok=True)
        WRITTEN_TABLES.drop(old)
    if pruned_algos:
        collect_garbage(run_dir, pruned_algos, [state.algo] + [_algo_of(p, run_dir) for p in kept if p != path])
    return path


class CheckpointWriter:
    """A run's checkpoints written behind its rounds: :meth:`submit` hands the write to the process's
    checkpoint thread (:func:`~flockfl.engine.runtime.in_background`) and returns, and the next
    round runs meanwhile (states are values: the round after builds new ones and leaves this one
    as it was). At most one write per run is in flight: the next :meth:`submit`, and :meth:`wait`
    (the run's end, an error, a crash drill), first wait for it and raise its error, so a failed
    write fails the run a round later at most. Checkpoints land in round order, each whole or
    absent as before; a process killed during a write resumes from the checkpoint before it (one
    round done again, the same bits). ``FLOCKFL_CHECKPOINT=foreground`` writes in the caller.

    A checkpoint whose unflushed client-table rows (``held``, bytes) are over ``MAX_HELD`` is written
    in the caller too: written behind, those rows stay in memory through the next round and add to
    its peak (10,000-client SCAFFOLD, 1,000 a round: 636 MB; docs/benchmarks.md)."""

    MAX_HELD = 256 << 20

    def __init__(self):
        self.behind = os.environ.get("FLOCKFL_CHECKPOINT", "behind") != "foreground"
        self.pending = None

    def submit(self, fn, *args, held: int = 0) -> None:
        self.wait()
        if not self.behind or held > self.MAX_HELD:
            fn(*args)
            return
        self.pending = in_background(fn, *args, lane="checkpoints")

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def unflushed_bytes(state: ServerState) -> int:
    """The bytes of the state's client-table rows not yet written (its next checkpoint writes them)."""
    return sum(t.row_nbytes * len(t.dirty) for _, t in tables(state.algo))


class TableIndex:
    """The client tables of the checkpoints this process wrote, by file and its signature (inode,
    size, mtime): garbage collection compares a pruned checkpoint's row digests with the kept
    ones' every round, and read them back by decoding each file (three a round with the default
    ``checkpoints_to_keep``: ~16 ms of a W1 SCAFFOLD round). A file replaced or rewritten since
    is decoded as before. Holds the tables (values: their digests, ~33 bytes a client, and no
    rows once flushed), least recently written out first past ``LIMIT_BYTES`` of digests: a
    million-client table's 33 MB fits twice, W1's 1,200 clients thousands of times."""

    LIMIT_BYTES = 64 << 20

    def __init__(self):
        self.entries: dict[str, tuple[tuple, dict, int]] = {}

    def put(self, path: Path, held: dict[str, ClientTable]) -> None:
        """Keep ``held`` (the state's tables by dotted path, as :func:`tables` walks them) for ``path``."""
        try:
            sig = signature(path)
        except OSError:
            return
        self.drop(path)
        self.entries[str(path)] = (sig, held, sum(t.digests.nbytes + t.has.nbytes for t in held.values()))
        while sum(e[2] for e in self.entries.values()) > self.LIMIT_BYTES:
            self.entries.pop(next(iter(self.entries)))

    def get(self, path: Path) -> Optional[dict]:
        hit = self.entries.get(str(path))
        try:
            return hit[1] if hit is not None and hit[0] == signature(path) else None
        except OSError:
            return None

    def drop(self, path: Path) -> None:
        self.entries.pop(str(path), None)


WRITTEN_TABLES = TableIndex()


def _algo_of(path: Path, run_dir: Path) -> dict:
    """The algo tree of a checkpoint (for garbage collection): its tables as this process wrote them
    (:data:`WRITTEN_TABLES`), else decoded; an unreadable one holds nothing (its rows are then left
    on disk, never a kept one's deleted)."""
    held = WRITTEN_TABLES.get(path)
    if held is not None:
        return held
    try:
        return decode_state(path.read_bytes(), str(path), run_dir).algo
    except (CheckpointError, OSError):
        return {}


def list_checkpoints(run_dir: Path) -> list[Path]:
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if CKPT_RE.match(p.name))


def load_latest(run_dir: Path) -> tuple[Optional[ServerState], list[str]]:
    """The newest checkpoint that verifies, plus one warning per rejected newer file."""
    warnings = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return decode_state(path.read_bytes(), str(path), Path(run_dir)), warnings
        except (CheckpointError, OSError) as err:
            warnings.append(f"refused {err}; falling back to the previous checkpoint")
    return None, warnings


def log_round(state: ServerState, **counts: float) -> None:
    """Add counts to this round's history row (summed over a round's cycles), e.g.
    ``log_round(state, clients_migrated=3, bytes_p2p=...)``."""
    log = dict(state.meta.get("round_log") or {})
    for k, v in counts.items():
        log[k] = log.get(k, 0) + v
    state.meta = {**state.meta, "round_log": log}  # new dicts: earlier states sharing meta are untouched


def on_device(state: ServerState, device: torch.device, keys: tuple[str, ...] = ()) -> ServerState:
    """The state with its tensors where a straight run keeps them. A checkpoint holds CPU
    tensors; a run resumed on a GPU moves back to the device its models, every dict in
    ``state.algo`` keyed by parameter names (server moments, control variates, past models:
    tensors built from the models) and the tensors under the top-level ``keys`` of
    ``state.algo`` (``Algorithm.device_state_keys``). Other algorithm tensors (labels,
    matrices, client tables) stay as loaded. For a state already in place nothing changes."""
    names = set(state.models)

    def place(tree, whole=False):
        if isinstance(tree, torch.Tensor) and whole:
            return tree.to(device)
        if isinstance(tree, dict):
            if whole:
                return {k: place(v, True) for k, v in tree.items()}
            if tree and set(tree) <= names and all(isinstance(v, torch.Tensor) for v in tree.values()):
                return {k: v.to(device) for k, v in tree.items()}
            return {k: place(v) for k, v in tree.items()}
        return tree

    if all(v.device == device for v in state.models.values()) and device.type == "cpu":
        return state  # a CPU run: checkpoints restore it as it was
    algo = {k: place(v, k in keys) for k, v in state.algo.items()}
    return state.replace(models={k: v.to(device) for k, v in state.models.items()}, algo=algo)


def _hash_named(h, tensors: dict[str, torch.Tensor]) -> None:
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())


def params_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors (names, shapes, bytes): the same bits give the same digest."""
    h = hashlib.sha256()
    _hash_named(h, tensors)
    return h.hexdigest()
