"""Local training of a cohort, written once: split into shards (each one vectorised batch of
clients), train each shard (retried), isolate the clients of a shard that still fails, drop
those that fail alone, concatenate. The plain loop, the Prefect flow and the Dask executor
differ only in the function that runs the shards (``shard_loop``'s ``run``)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from flockfl.algorithms import ALGORITHMS
from flockfl.context import RunContext
from flockfl.engine import TRAINERS, LocalSpec, TrainResult
from flockfl.engine.schedule import restrict, split_spec
from flockfl.stages.base import Stage


class ClientFailure(RuntimeError):
    """Local training of one or more clients failed."""


def train_shard(ctx: RunContext, spec: LocalSpec, engine: str, round: int, stages: Sequence[Stage] = ()) -> TrainResult:
    """Train one shard; raise :class:`ClientFailure` if any client failed or diverged. The
    stages' ``after_train`` (Sub-FedAvg's client-side pruning) is part of the shard's work."""
    bad = sorted(set(int(c) for c in spec.clients) & set(ctx.cfg.train.simulate_failures))
    if bad:
        raise ClientFailure(f"simulated failure of clients {bad}")
    result = TRAINERS[engine](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round)
    finite = result.finite()
    if not bool(finite.all()):
        raise ClientFailure(f"non-finite parameters from clients {result.clients[~finite.cpu().numpy()].tolist()}")
    for st in stages:
        result = st.after_train(ctx, spec, result)
    if spec.second is not None:  # the shard's second pass (the personal models), same clients
        run = ALGORITHMS[spec.second.method].second_pass
        result.meta = {**result.meta, "personal": run(ctx.model, spec, ctx.data.train, ctx.data.task, engine, ctx.seed, round)}
    return result


def isolate_failures(ctx: RunContext, spec: LocalSpec, engine: str, round: int, stages: Sequence[Stage] = ()
                     ) -> tuple[Optional[TrainResult], list[int]]:
    """After a shard failed its retries: train its clients one by one, drop those that fail."""
    parts, dropped = [], []
    for one in split_spec(spec, 1):
        try:
            parts.append(train_shard(ctx, one, engine, round, stages))
        except Exception:
            dropped.append(int(one.clients[0]))
    return (TrainResult.concat(parts) if parts else None), dropped


def restrict_spec(spec: LocalSpec, clients: np.ndarray) -> LocalSpec:
    """The spec of the clients that survived (their per-client rows follow them)."""
    if len(clients) == len(spec.clients) and np.array_equal(clients, spec.clients):
        return spec
    pos = {int(c): i for i, c in enumerate(spec.clients)}
    return restrict(spec, np.array([pos[int(c)] for c in clients], dtype=np.int64))


def retrying(fn: Callable[[], TrainResult], retries: int) -> Optional[TrainResult]:
    """``fn()``, tried ``retries + 1`` times; None when every try raised."""
    for _ in range(retries + 1):
        try:
            return fn()
        except Exception:
            continue
    return None


def shard_loop(spec: LocalSpec, shard_size: int, run: Callable[[list[LocalSpec]], Iterable[Optional[TrainResult]]],
               isolate: Callable[[LocalSpec], tuple[Optional[TrainResult], list[int]]]
               ) -> tuple[Optional[TrainResult], list[int]]:
    """The cohort's training: ``run(shards)`` gives each shard's result in shard order (None for
    a shard that failed its retries), whose clients ``isolate`` then trains one by one. Returns
    the concatenated result (None when no client trained) and the dropped clients."""
    shards = split_spec(spec, shard_size)
    parts, dropped = [], []
    for shard, result in zip(shards, run(shards)):
        if result is None:
            result, lost = isolate(shard)
            dropped += lost
        if result is not None:
            parts.append(result)
    return (TrainResult.concat(parts) if parts else None), dropped
