"""The stages of a round as plain functions (what ``tasks/`` wraps), and a plain loop.

``run_rounds`` drives the same stages without Prefect; the flow in ``flows/experiment.py``
calls them as tasks. Both produce bit-identical states for the same config.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from flockfl.algorithms import Algorithm, RunContext, build_algorithm
from flockfl.config import ExperimentConfig
from flockfl.data import build_client_data, build_or_load, load_dataset
from flockfl.engine import TRAINERS, LocalSpec, TrainResult, choose_engine, configure_threads, resolve_device
from flockfl.engine.schedule import restrict
from flockfl.state import ServerState
from models import build_model


class ClientFailure(RuntimeError):
    """Local training of one or more clients failed."""


@dataclass
class PreparedRun:
    cfg: ExperimentConfig
    ctx: RunContext
    algorithm: Algorithm
    partition_path: Path
    partition_hash: str
    partition_cached: bool
    threads: int
    info: dict = field(default_factory=dict)


def prepare(cfg: ExperimentConfig, partitions_root: str | Path = "data/partitions") -> PreparedRun:
    """Load the data, build or load the partition (content-addressed cache), and the model."""
    threads = configure_threads(cfg.train.threads)
    ds = load_dataset(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    part, path, cached = build_or_load(ds, cfg, partitions_root)
    data = build_client_data(ds, part).to(resolve_device(cfg.train.device))
    model = build_model(cfg.model.name, data.input_shape, data.num_outputs, cfg.model.hidden).to(data.train.x.device)
    truth = {"theta": ds.meta["theta"]} if "theta" in ds.meta else {}
    ctx = RunContext(cfg, model, data, truth)
    return PreparedRun(cfg, ctx, build_algorithm(cfg), path, part.content_hash, cached, threads)


# ---------------------------------------------------------------------- training


def split_spec(spec: LocalSpec, shard_size: int) -> list[LocalSpec]:
    """Shards of the cohort, each a vectorised batch of up to ``shard_size`` clients
    (none for an empty cohort: under CC-FL a round can have no participants)."""
    n = len(spec.clients)
    if n == 0:
        return []
    if n <= shard_size:
        return [spec]
    return [restrict(spec, slice(a, min(n, a + shard_size))) for a in range(0, n, shard_size)]


def train_shard(ctx: RunContext, spec: LocalSpec, engine: str, round: int) -> TrainResult:
    """Train one shard; raise :class:`ClientFailure` if any client failed or diverged."""
    bad = sorted(set(int(c) for c in spec.clients) & set(ctx.cfg.train.simulate_failures))
    if bad:
        raise ClientFailure(f"simulated failure of clients {bad}")
    result = TRAINERS[engine](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round)
    # a sum is non-finite iff some entry is (inf − inf gives nan): one read, no mask tensor
    finite = torch.stack([torch.isfinite(v.reshape(len(result.clients), -1).sum(1)) for v in result.params.values()]).all(0)
    if not bool(finite.all()):
        raise ClientFailure(f"non-finite parameters from clients {result.clients[~finite.cpu().numpy()].tolist()}")
    return result


def isolate_failures(ctx: RunContext, spec: LocalSpec, engine: str, round: int) -> tuple[Optional[TrainResult], list[int]]:
    """After a shard failed its retries: train its clients one by one, drop those that fail."""
    parts, dropped = [], []
    for one in split_spec(spec, 1):
        try:
            parts.append(train_shard(ctx, one, engine, round))
        except Exception:
            dropped.append(int(one.clients[0]))
    return (TrainResult.concat(parts) if parts else None), dropped


def restrict_spec(spec: LocalSpec, clients: np.ndarray) -> LocalSpec:
    """The spec of the clients that survived (their per-client rows follow them)."""
    if len(clients) == len(spec.clients) and np.array_equal(clients, spec.clients):
        return spec
    pos = {int(c): i for i, c in enumerate(spec.clients)}
    return restrict(spec, np.array([pos[int(c)] for c in clients], dtype=np.int64))


def pick_engine(prep: PreparedRun, state: ServerState, spec: LocalSpec) -> str:
    """The trainer for this run: the configured one, or (auto) the faster on the first cohort.

    The choice is stored in the state so that a resumed run keeps it (bit-identical)."""
    if "engine" in state.meta:
        return state.meta["engine"]
    cfg = prep.cfg.train
    if len(spec.clients) == 0:  # nothing to time or train this round; decide on a real cohort
        return "vectorized" if cfg.engine == "auto" else cfg.engine
    if cfg.engine != "auto":
        state.meta["engine"], state.meta["engine_reason"] = cfg.engine, "configured"
        return cfg.engine
    shard = split_spec(spec, cfg.shard_size)[0]
    choice, timings = choose_engine(prep.ctx.model, shard, prep.ctx.data.train, prep.ctx.data.task, prep.cfg.seed)
    state.meta["engine"] = choice
    state.meta["engine_reason"] = "auto: " + ", ".join(f"{k}={v:.4f}" for k, v in timings.items())
    return choice


# ---------------------------------------------------------------------- one round, plain


def should_evaluate(cfg: ExperimentConfig, round: int) -> bool:
    """Every ``train.eval_every`` rounds, and always after the last one."""
    return (round + 1) % cfg.train.eval_every == 0 or round + 1 == cfg.train.rounds


def finish_round(prep: PreparedRun, state: ServerState, clients: np.ndarray, metrics: Optional[dict[str, Any]],
                 dropped: list[int], wall: float, result: Optional[TrainResult] = None) -> tuple[ServerState, dict[str, Any]]:
    """Fold one round into the state: history row, assignment history, counter.

    ``metrics`` is None for a round that was not evaluated: its row then has only the
    round's accounting, and its assignment-history row repeats the last known assignments.
    ``sim_round_time`` uses the local steps the trained clients actually took.
    """
    alg = prep.algorithm
    down, up = alg.comm_bytes(state, clients)
    trained = result.clients if result is not None else np.zeros(0, np.int64)
    steps = result.num_steps if result is not None else np.zeros(0)
    sim_round = alg.sim_round_time(state, prep.ctx, trained, steps)
    sim_total = (state.history[-1]["sim_time"] if state.history else 0.0) + sim_round
    row = {k: v for k, v in (metrics or {}).items() if not k.startswith("_")}
    row.update({"round": state.round + 1, "clients": len(clients), "clients_dropped": len(dropped),
                "bytes_down": down, "bytes_up": up, "bytes_total": down + up, "round_time_s": wall,
                "sim_round_time": sim_round, "sim_time": sim_total})
    assigned = metrics["_assignment"] if metrics else state.assignments
    hist = np.vstack([state.assignment_history, assigned[None, :]])
    return state.replace(round=state.round + 1, history=state.history + [row], assignment_history=hist), row


def run_round(prep: PreparedRun, state: ServerState, round: int) -> tuple[ServerState, dict[str, Any]]:
    """select → train (sharded) → cluster → aggregate → evaluate, with no orchestrator."""
    t0 = time.perf_counter()
    alg, ctx = prep.algorithm, prep.ctx
    clients = alg.select(state, ctx, round)
    spec = alg.local_spec(state, ctx, clients, round)
    engine = pick_engine(prep, state, spec)
    parts, dropped = [], []
    for shard in split_spec(spec, prep.cfg.train.shard_size):
        try:
            parts.append(train_shard(ctx, shard, engine, round))
        except Exception:
            part, lost = isolate_failures(ctx, shard, engine, round)
            parts += [part] if part is not None else []
            dropped += lost
    result = TrainResult.concat(parts) if parts else None
    if result is not None:
        spec = restrict_spec(spec, result.clients)
        assign = alg.cluster(state, ctx, spec, result)
        state = alg.aggregate(state, ctx, spec, result, assign)
    metrics = alg.evaluate(state, ctx) if should_evaluate(prep.cfg, round) else None
    return finish_round(prep, state, clients, metrics, dropped, time.perf_counter() - t0, result)


def run_rounds(prep: PreparedRun, state: Optional[ServerState] = None, until: Optional[int] = None,
               on_round: Optional[Callable[[ServerState, dict], None]] = None) -> ServerState:
    state = state or prep.algorithm.init_state(prep.ctx)
    for r in range(state.round, until if until is not None else prep.cfg.train.rounds):
        state, row = run_round(prep, state, r)
        if on_round:
            on_round(state, row)
    return state


def time_to_target(history: list[dict], target: Optional[float]) -> dict[str, Any]:
    """The first evaluated round whose mean accuracy reaches ``target``, and its sim_time."""
    if target is None:
        return {}
    hit = next((h for h in history if h.get("accuracy", -1.0) >= target), None)
    return {"target_accuracy": target, "rounds_to_target": hit["round"] if hit else None,
            "sim_time_to_target": hit["sim_time"] if hit else None}


def summarise(state: ServerState, target: Optional[float] = None) -> dict[str, Any]:
    """Final metrics, the median round time leaving out the first round, and time to target."""
    last = state.history[-1] if state.history else {}
    keep = ("accuracy", "accuracy_min", "accuracy_p10", "loss", "ari", "nmi", "num_clusters", "min_dist", "sim_time")
    metrics = {k: last[k] for k in keep if k in last and not (isinstance(last[k], float) and math.isnan(last[k]))}
    times = [h["round_time_s"] for h in state.history[1:]] or [h["round_time_s"] for h in state.history]
    return {"metrics": metrics, "round_s_median": float(np.median(times)) if times else float("nan"),
            **time_to_target(state.history, target)}
