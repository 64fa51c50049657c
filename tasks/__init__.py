"""Prefect tasks: thin wrappers over the flockfl stage functions.

No algorithm logic lives here. Tasks pass Python objects in memory (thread-pool runner),
so they use ``NO_CACHE`` and ``persist_result=False``: hashing or pickling model weights on
every call would cost more than the work. Durable state is the checkpoint file, written by
``checkpoint``; partitions are cached by content address on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from flockfl import rounds
from flockfl.engine import LocalSpec, TrainResult
from flockfl.faults import maybe_crash
from flockfl.state import ServerState, load_latest, save_checkpoint

_quiet = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="partition", **_quiet)
def partition(cfg, partitions_root: str) -> rounds.PreparedRun:
    """Load the dataset and build the partition, or load it from its content-addressed file."""
    return rounds.prepare(cfg, partitions_root)


@task(name="restore", **_quiet)
def restore(prep: rounds.PreparedRun, run_dir: str) -> tuple[ServerState, list[str]]:
    """The latest good checkpoint in ``run_dir``, or a fresh round-0 state."""
    state, warnings = load_latest(Path(run_dir))
    if state is None:
        state = prep.algorithm.init_state(prep.ctx)
    return state, warnings


@task(name="select", **_quiet)
def select(prep: rounds.PreparedRun, state: ServerState, round: int) -> LocalSpec:
    """Choose the cohort and how each client trains (``select`` + ``local_spec`` hooks)."""
    alg = prep.algorithm
    clients = alg.select(state, prep.ctx, round)
    spec = alg.local_spec(state, prep.ctx, clients, round)
    maybe_crash("select", round)
    return spec


@task(name="train_shard", **_quiet)
def train_shard(prep: rounds.PreparedRun, spec: LocalSpec, engine: str, round: int) -> TrainResult:
    return rounds.train_shard(prep.ctx, spec, engine, round)


@task(name="isolate_failures", **_quiet)
def isolate_failures(prep: rounds.PreparedRun, spec: LocalSpec, engine: str, round: int):
    return rounds.isolate_failures(prep.ctx, spec, engine, round)


@task(name="cluster", **_quiet)
def cluster(prep: rounds.PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult) -> np.ndarray:
    return prep.algorithm.cluster(state, prep.ctx, spec, result)


@task(name="aggregate", **_quiet)
def aggregate(prep: rounds.PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult,
              assign: np.ndarray, round: int) -> ServerState:
    new = prep.algorithm.aggregate(state, prep.ctx, spec, result, assign)
    maybe_crash("aggregate", round)
    return new


@task(name="evaluate", **_quiet)
def evaluate(prep: rounds.PreparedRun, state: ServerState, round: int) -> dict[str, Any]:
    metrics = prep.algorithm.evaluate(state, prep.ctx)
    maybe_crash("evaluate", round)
    return metrics


@task(name="checkpoint", **_quiet)
def checkpoint(state: ServerState, run_dir: str, keep: int) -> str:
    path = save_checkpoint(state, Path(run_dir), keep)
    maybe_crash("checkpoint", state.round - 1)
    return str(path)


@task(name="log_metrics", **_quiet)
def log_metrics(tracker, rows: list[dict]) -> None:
    for row in rows:
        tracker.log_round(row)
