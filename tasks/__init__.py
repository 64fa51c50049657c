"""Prefect tasks: thin wrappers over the flockfl stage functions.

No algorithm logic lives here. Tasks pass Python objects in memory (thread-pool runner),
so they use ``NO_CACHE`` and ``persist_result=False``: hashing or pickling model weights on
every call would cost more than the work. Durable state is the checkpoint file, written by
``checkpoint``; partitions are cached by content address on disk.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from flockfl import rounds, training
from flockfl.engine import LocalSpec, TrainResult
from flockfl.faults import maybe_crash
from flockfl.state import ServerState, checkpoint_path, load_latest, save_checkpoint, unflushed_bytes

_quiet = dict(cache_policy=NO_CACHE, persist_result=False)


def _mlflow_params(uri: str) -> dict:
    """A model's parameters from an MLflow model URI (curriculum.expert=models:/NAME/VERSION)."""
    import mlflow.pytorch

    net = mlflow.pytorch.load_model(uri, map_location="cpu")
    return {n: p.detach() for n, p in net.named_parameters()}


# the model URIs a run's config may name (curriculum.expert), read with MLflow (flockfl.inputs)
READERS = {"models:/": _mlflow_params, "runs:/": _mlflow_params}

# Seconds spent inside task bodies, so the flow can report what orchestration itself costs
# (round wall time minus time in the bodies).
BODY_SECONDS = [0.0]


@functools.lru_cache(maxsize=None)
def retried(task, retries: int):
    """``task`` with ``retries`` and no delay, made once per count: Prefect's ``with_options``
    reads and hashes the function's source each time (~3 ms a round)."""
    return task.with_options(retries=retries, retry_delay_seconds=0)


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            BODY_SECONDS[0] += time.perf_counter() - t0

    return wrapper


@task(name="partition", **_quiet)
@timed
def partition(cfg, partitions_root: str) -> rounds.PreparedRun:
    """Load the dataset and build the partition, or load it from its content-addressed file."""
    return rounds.prepare(cfg, partitions_root, readers=READERS)


@task(name="restore", **_quiet)
@timed
def restore(prep: rounds.PreparedRun, run_dir: str) -> tuple[ServerState, list[str]]:
    """The latest good checkpoint in ``run_dir``, or a fresh round-0 state."""
    state, warnings = load_latest(Path(run_dir))
    if state is None:
        state = prep.algorithm.init_state(prep.ctx)
    return state, warnings


@task(name="pre_federation", **_quiet)
@timed
def pre_federation(prep: rounds.PreparedRun, state: ServerState) -> ServerState:
    """The algorithm's one-shot step before round 0 (signatures, one-shot clustering)."""
    return rounds.pre_federation_stage(prep, state)


@task(name="select", **_quiet)
@timed
def select(prep: rounds.PreparedRun, state: ServerState, round: int) -> tuple[ServerState, LocalSpec]:
    """Choose the cohort, apply the round's shift and the algorithm's scheduling, and decide how
    each client trains (``select``, ``shift``, ``before_training``, ``local_spec``)."""
    return rounds.select_stage(prep, state, round)


@task(name="train_shard", **_quiet)
@timed
def train_shard(prep: rounds.PreparedRun, spec: LocalSpec, engine: str, round: int) -> "quote[TrainResult]":
    """The shard's result, quoted: Prefect links a task's result to its state by walking it one
    level deep, and reading ``TrainResult.params`` would write out the low-rank weights that the
    aggregate reduces on their factors (``TrainResult.raw_params``). ``.unquote()`` it."""
    return quote(training.train_shard(prep.ctx, spec, engine, round, tuple(prep.stages.values())))


def _retry_unless_setup_error(task, task_run, state) -> bool:
    """A worker that cannot read the run's data fails the same way every time: no retry."""
    from flockfl.errors import ExecutorError

    try:
        state.result()
    except ExecutorError:
        return False
    except Exception:
        return True
    return True


@task(name="train_shard_remote", retry_condition_fn=_retry_unless_setup_error, **_quiet)
def train_shard_remote(job: bytes) -> bytes:
    """One training shard on a Dask worker (``executor.kind=dask``): ``job`` is a pickled
    :class:`flockfl.executor.ShardJob` (the shard's rows, no dataset); returns the pickled
    (TrainResult, info). The worker loads the data once per process by content hash."""
    from flockfl.executor import run_job

    return run_job(job)


@task(name="isolate_failures", **_quiet)
@timed
def isolate_failures(prep: rounds.PreparedRun, spec: LocalSpec, engine: str, round: int):
    return training.isolate_failures(prep.ctx, spec, engine, round, tuple(prep.stages.values()))


@task(name="cluster", **_quiet)
@timed
def cluster(prep: rounds.PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult) -> np.ndarray:
    return rounds.cluster_stage(prep, state, spec, result)


@task(name="aggregate", **_quiet)
@timed
def aggregate(prep: rounds.PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult,
              assign: np.ndarray, round: int) -> ServerState:
    return rounds.aggregate_stage(prep, state, spec, result, assign, round)


@task(name="evaluate", **_quiet)
@timed
def evaluate(prep: rounds.PreparedRun, state: ServerState, round: int) -> dict[str, Any]:
    return rounds.evaluate_stage(prep, state, round)


@task(name="checkpoint", **_quiet)
@timed
def checkpoint(writer, state: ServerState, run_dir: str, keep: int) -> str:
    """Hand the state's checkpoint to the run's writer (:class:`flockfl.state.CheckpointWriter`:
    written behind the next round); returns the path it is written to."""
    writer.submit(write_checkpoint, state, run_dir, keep, held=unflushed_bytes(state))
    return str(checkpoint_path(Path(run_dir), state.round))


def write_checkpoint(state: ServerState, run_dir: str, keep: int) -> None:
    save_checkpoint(state, Path(run_dir), keep)
    maybe_crash("checkpoint", state.round - 1)


@task(name="log_metrics", **_quiet)
@timed
def log_metrics(tracker, rows: list[dict]) -> None:
    """Queue the rounds' metrics (a BackgroundTracker logs them off the round's path; rows it
    already holds are skipped)."""
    tracker.log_rounds([dict(row) for row in rows])


@task(name="train_stack", **_quiet)
@timed
def train_stack(calls: list) -> int:
    """The waiting passes of a stack's cells, trained together where they can share a pass
    (:func:`flockfl.engine.stacking.train_calls`); returns how many passes it took."""
    from flockfl.engine.stacking import train_calls

    return train_calls(calls)
