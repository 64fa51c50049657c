"""The stages of a round as plain functions (what ``tasks/`` wraps), and a plain loop.

``run_rounds`` drives the same stages without Prefect; the flow in ``flows/experiment.py``
calls them as tasks. Both produce bit-identical states for the same config. A run is made
ready by :mod:`flockfl.preparation` (``prepare``, ``prepare_data`` and their checks, re-exported
here: scripts import them from ``flockfl.rounds``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from flockfl.algorithms import Algorithm
from flockfl.clientstate import chunks
from flockfl.config import ExperimentConfig
from flockfl.context import RunContext
from flockfl.engine import LocalSpec, TrainResult
from flockfl.engine.probe import cached_choice
from flockfl.eval_protocol import ClientMetrics, Protocol, family, protocol
from flockfl.eval_reuse import EvalReuse
from flockfl.eval_summary import note_trained, report_modes
from flockfl.evaluation import measure_own, measure_shared
from flockfl import optimizer_state
from flockfl.faults import maybe_crash
from flockfl.preparation import PreparedRun, assemble, check_population, check_task, prepare, prepare_data
from flockfl.state import ServerState, on_device
from flockfl.training import isolate_failures, restrict_spec, retrying, shard_loop, split_spec, train_shard

__all__ = ["aggregate_stage", "assemble", "check_population", "check_task", "cluster_stage", "cycle_share", "drive",
           "drive_round", "evaluate_all", "evaluate_stage", "finish_round", "needs_pre_federation", "newcomer_metrics", "pick_engine",
           "PLAIN", "pre_federation_stage", "prepare", "prepare_data", "PreparedRun", "RoundWork", "run_round",
           "run_rounds", "select_stage", "should_evaluate", "Stages", "train_companions", "train_stage"]


def pick_engine(prep: PreparedRun, state: ServerState, spec: LocalSpec) -> str:
    """The trainer for this run: the configured one, or (auto) the faster on the first cohort.

    The choice is stored in the state so that a resumed run keeps it (bit-identical), and set
    on the context (``ctx.trainer``) for every pass outside the round's training."""
    cfg, run = prep.cfg.train, state.driver
    if run.engine is not None or len(spec.clients) == 0:  # an empty cohort: decide on a real one
        return prep.ctx.engine_name  # drive_round set ctx.engine from the state
    if cfg.engine != "auto":
        run.engine, run.engine_reason = cfg.engine, "configured"
    else:
        run.engine, timings, cached = cached_choice(prep.ctx.model, split_spec(spec, cfg.shard_size)[0],
                                                    prep.ctx.data.train, prep.ctx.data.task, prep.cfg.seed)
        run.engine_reason = ("auto (cached): " if cached else "auto: ") + ", ".join(f"{k}={v:.4f}"
                                                                                     for k, v in timings.items())
    prep.ctx.engine = run.engine
    return run.engine


# ---------------------------------------------------------------------- stages
# Each stage is a plain function of (prep, ...). The plain loop calls them directly; the
# Prefect flow hands task-wrapped versions of the same functions to the same driver.


def pre_federation_stage(prep: PreparedRun, state: ServerState) -> ServerState:
    """The algorithm's one-shot pre-federation step, timed; its cost goes into the state."""
    t0 = time.perf_counter()
    new = prep.algorithm.pre_federation(state, prep.ctx)
    cost = new.meta.pop("pre_federation_bytes", {"up": 0, "down": 0})  # the algorithm's count, handed over
    cost = {"seconds": time.perf_counter() - t0, "bytes_up": int(cost["up"]), "bytes_down": int(cost["down"])}
    new = new.replace(driver=dataclasses.replace(new.driver, pre_federation=cost))
    maybe_crash("pre_federation", 0)
    return new


def select_stage(prep: PreparedRun, state: ServerState, round: int) -> tuple[ServerState, LocalSpec]:
    """Choose the cohort (``select``), apply the round's distribution shift (``shift.*``), let
    the algorithm react to the data (``before_training``: FlexCFL's migration and cold start),
    then decide how each client trains (``local_spec``).

    Called once per cycle (``state.driver.cycle``; one cycle unless ``cycles_per_round`` says
    more). The stages' ``select`` and ``after_select`` act on the round, so they run in its first
    cycle only: a multi-cycle round is shifted once, and a run resumed at cycle c > 0 finds the
    shift in the checkpointed state. A stage that replaces the cohort (a client curriculum)
    chooses the round's cohort there; it is kept in ``state.driver.round_cohort`` for the rest
    of the round and every cycle trains its share of it (:func:`cycle_share`)."""
    alg, ctx, stages = prep.algorithm, prep.ctx, prep.stages.values()
    for st in stages:
        st.sync(ctx, state)
    clients = alg.select(state, ctx, round)
    if state.driver.cycle == 0:  # round-level hooks: once per round
        drawn = clients
        for st in stages:
            clients = st.select(ctx, state, alg, clients, round)
        for st in stages:
            state = st.after_select(ctx, alg, state, round)
        if any(st.replaces_cohort for st in stages) and alg.cycles_per_round(state, ctx) > 1:
            state = state.replace(driver=dataclasses.replace(state.driver, round_cohort=[int(c) for c in clients]))
            clients = drawn
    if state.driver.round_cohort is not None:
        clients = cycle_share(alg, state, ctx, round, np.asarray(state.driver.round_cohort, np.int64), clients)
    state = alg.before_training(state, ctx, clients, round)
    spec = alg.local_spec(state, ctx, clients, round)
    if ctx.cfg.train.momentum and not spec.momentum:  # train.momentum: local momentum for any algorithm
        spec = dataclasses.replace(spec, momentum=ctx.cfg.train.momentum)
    for st in stages:
        spec = st.on_spec(ctx, state, spec, round)
    spec = optimizer_state.gather_into(ctx.cfg, state, spec, ctx.data.train.x.device)  # persist: last round's buffers
    maybe_crash("select", round)
    return state, spec


def cycle_share(alg: Algorithm, state: ServerState, ctx: RunContext, round: int, cohort: np.ndarray,
                drawn: np.ndarray) -> np.ndarray:
    """The part of the round's cohort (chosen once per round by a stage) that the running cycle
    trains: its members among the clients the algorithm's cycle draws from
    (``cycle_candidates``: FedCluster's cluster σ_j(K)), or, for an algorithm that names none,
    among the cycle's own draw ``drawn``. Over FedCluster's M cycles the shares partition the
    cohort: every client of it trains exactly once in the round."""
    pool = alg.cycle_candidates(state, ctx, round)
    pool = drawn if pool is None else pool
    return np.intersect1d(cohort, np.asarray(pool, np.int64)).astype(np.int64)


def train_stage(prep: PreparedRun, spec: LocalSpec, engine: str, round: int) -> tuple[Optional[TrainResult], list[int]]:
    """Train the cohort shard by shard, in this process (the plain loop's submit function)."""
    t = prep.cfg.train
    stages = tuple(prep.stages.values())

    def run(shards: list[LocalSpec]):
        for shard in shards:
            yield retrying(lambda: train_shard(prep.ctx, shard, engine, round, stages), t.max_retries)

    return shard_loop(spec, t.shard_size, run, lambda shard: isolate_failures(prep.ctx, shard, engine, round, stages))


def cluster_stage(prep: PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult) -> np.ndarray:
    return prep.algorithm.cluster(state, prep.ctx, spec, result)


def aggregate_stage(prep: PreparedRun, state: ServerState, spec: LocalSpec, result: TrainResult,
                    assign: np.ndarray, round: int) -> ServerState:
    sent = result
    for st in prep.stages.values():
        sent = st.before_aggregate(prep.algorithm, state, sent, assign)
    new = prep.algorithm.aggregate(state, prep.ctx, spec, sent, assign)
    for st in prep.stages.values():
        st.after_aggregate(new, result)
    maybe_crash("aggregate", round)
    return new


def evaluate_stage(prep: PreparedRun, state: ServerState, round: int) -> dict[str, Any]:
    """The algorithm's evaluation (each client with its cluster or global model, un-tuned);
    then, per ``train.eval_finetune``, the same after local fine-tuning (the thesis's
    convention); after the last round, the newcomers join and are measured."""
    ctx, cfg = prep.ctx, prep.cfg
    for st in prep.stages.values():
        st.sync(ctx, state)
    ctx.eval_reuse = EvalReuse.restore(state.driver.eval_reuse) if cfg.eval.reuse else None
    try:
        metrics = evaluate_all(prep, state, round)
    finally:
        store, ctx.eval_reuse = ctx.eval_reuse, None
    metrics["_eval_reuse"] = store  # finish_round keeps it in the driver's record (checkpointed)
    maybe_crash("evaluate", round)
    return metrics


def evaluate_all(prep: PreparedRun, state: ServerState, round: int) -> dict[str, Any]:
    """The algorithm's, the stages', the fine-tuned and the newcomers' metrics (``evaluate_stage``)."""
    alg, ctx, cfg = prep.algorithm, prep.ctx, prep.cfg
    metrics = alg.evaluate(state, ctx)
    last = round + 1 == cfg.train.rounds
    tune = cfg.train.eval_finetune == "every" or (cfg.train.eval_finetune == "final" and last)
    for st in prep.stages.values():
        metrics.update(st.on_evaluate(prep, state, metrics, round, tune))
    if tune:  # in chunks: memory holds one chunk's fine-tuned models (and their training's workspace)
        parts = []
        for part in chunks(ctx.seen, finetune_chunk(state, cfg)):
            res = alg.finetune(state, ctx, part, metrics["_assignment"][part], round, "finetune")
            parts.append(measure_own(ctx, res.params, part))
        metrics.update(family(ClientMetrics.join(parts), protocol(ctx), ctx.data.task, "_finetuned"))
    if last and len(ctx.unseen):
        metrics.update(newcomer_metrics(prep, state, round))
    return metrics


def finetune_chunk(state: ServerState, cfg) -> int:
    """Clients fine-tuned at once: ``train.eval_chunk``, or fewer where their models would take
    more than ``train.finetune_chunk_mb`` (a 159,010-weight MLP: 636 KB a client, 50 at 32 MB;
    the chunking does not change the numbers)."""
    row = sum(v[0].numel() * v.element_size() for v in state.models.values())
    return max(1, min(cfg.train.eval_chunk, int(cfg.train.finetune_chunk_mb * 2**20) // max(row, 1)))


def newcomer_metrics(prep: PreparedRun, state: ServerState, round: int) -> dict[str, Any]:
    """Newcomers join by the algorithm's rule, then fine-tune ``train.finetune_epochs``
    epochs: ``unseen_accuracy`` (after fine-tuning, the thesis's metric) and
    ``unseen_accuracy_untuned`` (the model they were given)."""
    alg, ctx = prep.algorithm, prep.ctx
    joined, assign, rule = alg.admit_newcomers(state, ctx, ctx.unseen)
    proto, task = protocol(ctx), ctx.data.task
    untuned = measure_shared(ctx, joined.models, assign, ctx.unseen)
    res = alg.finetune(joined, ctx, ctx.unseen, assign, round, "newcomer")
    out = family(measure_own(ctx, res.params, ctx.unseen), proto, task, wrap=lambda k: f"unseen_{k}")
    out.update(family(untuned, proto, task, wrap=lambda k: f"unseen_{k}_untuned"))
    out["_newcomers"] = {"clients": ctx.unseen.tolist(), "clusters": assign.tolist(), "rule": rule,
                         "new_clusters": int(joined.k - state.k)}
    return out


@dataclass
class Stages:
    """The stage functions a round calls (the plain ones by default)."""

    pre_federation: Callable = pre_federation_stage
    select: Callable = select_stage
    train: Callable = train_stage
    cluster: Callable = cluster_stage
    aggregate: Callable = aggregate_stage
    evaluate: Callable = evaluate_stage


PLAIN = Stages()


# ---------------------------------------------------------------------- the round driver


def should_evaluate(cfg: ExperimentConfig, round: int) -> bool:
    """Every ``train.eval_every`` rounds, and always after the last one."""
    return (round + 1) % cfg.train.eval_every == 0 or round + 1 == cfg.train.rounds


@dataclass
class RoundWork:
    """What a round's cycles did so far (one cycle unless ``cycles_per_round`` says more);
    kept in ``state.driver.partial_round`` by a mid-round checkpoint."""

    cycle: int = 0
    clients: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    down: int = 0
    up: int = 0
    sim: float = 0.0
    thesis: float = 0.0  # pruning: the thesis's communication figure (spec §2.8)

    def add(self, prep: PreparedRun, received: ServerState, state: ServerState, clients: np.ndarray,
            dropped: list[int], result: Optional[TrainResult]) -> None:
        """Account one cycle: ``received`` is the state the cohort downloaded (after selection),
        ``state`` the one after aggregation. The download is charged on what was sent (FLIS-DC's
        T_t models, not the T_{t+1} the round made; a k that clustering changes), the upload on
        the state after aggregation (DIFCA's token holders are chosen there)."""
        alg = prep.algorithm
        down, _ = alg.comm_bytes(received, clients)
        _, up = alg.comm_bytes(state, clients)
        trained = result.clients if result is not None else np.zeros(0, np.int64)
        steps = result.num_steps if result is not None else np.zeros(0)
        self.clients += [int(c) for c in clients]
        self.dropped += list(dropped)
        for st in prep.stages.values() if result is not None else ():  # a pruned entry is not uploaded
            saved, thesis = st.upload(result)
            up, self.thesis = up - saved, self.thesis + thesis
        self.down, self.up = self.down + int(down), self.up + int(up)
        self.sim += alg.sim_round_time(state, prep.ctx, trained, steps)  # cycles run one after another


def finish_round(prep: PreparedRun, state: ServerState, work: RoundWork, metrics: Optional[dict[str, Any]],
                 wall: float) -> tuple[ServerState, dict[str, Any]]:
    """Fold one round into the state: history row, assignment history, counter.

    ``metrics`` is None for a round that was not evaluated: its row then has only the
    round's accounting, and its assignment-history row repeats the last known assignments.
    ``sim_round_time`` uses the local steps the trained clients actually took. Counts the
    round's stages logged (``state.meta['round_log']``: clients shifted, migrated, ...) join
    the row. The driver's record keeps the run's evaluation protocol and which clients have trained
    (for ``eval.report=best_after_all_seen``); the last round's row adds every report mode of
    every accuracy convention (``flockfl.eval_summary.report_modes``).
    """
    last = state.history[-1] if state.history else {}
    sim_total = last.get("sim_time", 0.0) + work.sim
    row = {k: v for k, v in (metrics or {}).items() if not k.startswith("_")}
    meta = {k: v for k, v in state.meta.items() if k != "round_log"}
    run = dataclasses.replace(state.driver, cycle=0, partial_round=None, round_cohort=None)
    row.update({k: v for k, v in (state.meta.get("round_log") or {}).items() if not k.startswith("_")})
    row.update({"round": state.round + 1, "clients": len(work.clients), "clients_dropped": len(work.dropped),
                "bytes_down": work.down, "bytes_up": work.up, "bytes_total": work.down + work.up, "round_time_s": wall,
                "sim_round_time": work.sim, "sim_time": sim_total,
                "comm_bytes": last.get("comm_bytes", 0) + work.down + work.up})
    for st in prep.stages.values():
        row.update(st.row(work.thesis, last))
    if metrics and "_newcomers" in metrics:
        run.newcomers = metrics["_newcomers"]
    if metrics is not None:  # the evaluation's stored metrics (eval.reuse; None when off)
        store = metrics.get("_eval_reuse")
        run.eval_reuse = store.payload() if store is not None else None
    proto = Protocol.of(prep.cfg)
    run.eval_protocol = proto.asdict()
    run = note_trained(run, np.setdiff1d(np.asarray(work.clients, np.int64), np.asarray(work.dropped, np.int64)),
                       prep.ctx.seen, state.round + 1)
    if metrics is not None and state.round + 1 == prep.cfg.train.rounds:
        row.update(report_modes(state.history + [row], proto.last_k, run.all_trained_round))
    assigned = metrics["_assignment"] if metrics else state.assignments
    hist = np.vstack([state.assignment_history, assigned[None, :]])
    return state.replace(round=state.round + 1, history=state.history + [row], assignment_history=hist, meta=meta,
                         driver=run), row


def drive_round(prep: PreparedRun, state: ServerState, round: int, stages: Stages = PLAIN,
                on_cycle: Optional[Callable[[ServerState], None]] = None) -> tuple[ServerState, dict[str, Any]]:
    """One round: select → train (sharded) → cluster → aggregate, once per cycle (FedCluster
    runs several), then evaluate. After every cycle but the last, ``on_cycle`` gets a state
    that resumes the round at the next cycle (the flow checkpoints it)."""
    t0 = time.perf_counter()
    prep.ctx.engine = state.driver.engine  # the trainer chosen in an earlier round (a resumed run's too)
    state = optimizer_state.with_table(prep.cfg, prep.ctx.model, prep.ctx.num_clients, state)
    work = RoundWork(**(state.driver.partial_round or {}))
    cycles = prep.algorithm.cycles_per_round(state, prep.ctx)
    for c in range(work.cycle, cycles):
        state = state.replace(driver=dataclasses.replace(state.driver, partial_round=None, cycle=c))
        state, spec = stages.select(prep, state, round)
        received = state  # what the cohort downloaded
        engine = pick_engine(prep, state, spec)
        result, dropped = stages.train(prep, spec, engine, round)
        maybe_crash("train", round)
        if result is not None:
            kept = restrict_spec(spec, result.clients)
            assign = stages.cluster(prep, state, kept, result)
            state = stages.aggregate(prep, state, kept, result, assign, round)
            state = optimizer_state.keep(prep.cfg, prep.algorithm.name, received, state, result)
            companion = prep.algorithm.companion_spec(received, prep.ctx, spec, round)
            if companion is not None:
                state = train_companions(prep, stages, state, companion, engine, round)
        work.add(prep, received, state, spec.clients, dropped, result)
        if c + 1 < cycles:
            work.cycle = c + 1
            state = state.replace(driver=dataclasses.replace(state.driver, partial_round=dataclasses.asdict(work)))
            if on_cycle:
                on_cycle(state)
            maybe_crash("cycle", round)
    spec = result = received = kept = None  # the cohort-sized tensors: let go before the evaluation
    metrics = stages.evaluate(prep, state, round) if should_evaluate(prep.cfg, round) else None
    return finish_round(prep, state, work, metrics, time.perf_counter() - t0)


def train_companions(prep: PreparedRun, stages: Stages, state: ServerState, companion: LocalSpec, engine: str,
                     round: int) -> ServerState:
    """The round's companion clients (``Algorithm.companion_spec``) through the train stage, in
    chunks of ``train.shard_size`` × the executor's workers (one shard per worker at a time),
    each folded into ``state`` by ``absorb_companions`` before the next trains. A companion
    that fails after its retries keeps its old state, and the run says so once."""
    t, ex = prep.cfg.train, prep.cfg.executor
    size = t.shard_size * (ex.workers if ex.kind == "dask" else 1)
    lost: list[int] = []
    for part in split_spec(companion, size):
        result, dropped = stages.train(prep, part, engine, round)
        lost += [int(c) for c in dropped]
        if result is not None:
            state = prep.algorithm.absorb_companions(state, prep.ctx, result)
    if lost:
        warnings.warn(f"round {round + 1}: companion clients {sorted(lost)} failed to train and keep their previous "
                      "state", RuntimeWarning, stacklevel=2)
    return state


def needs_pre_federation(prep: PreparedRun, state: ServerState) -> bool:
    return prep.algorithm.has_pre_federation() and state.driver.pre_federation is None


def drive(prep: PreparedRun, state: Optional[ServerState] = None, stages: Stages = PLAIN, until: Optional[int] = None,
          on_pre_federation: Optional[Callable[[ServerState], None]] = None,
          on_round: Optional[Callable[[ServerState, dict], None]] = None,
          on_cycle: Optional[Callable[[ServerState], None]] = None) -> ServerState:
    """The whole run: the pre-federation step (once, unless the state already holds it), then
    the rounds from ``state.round`` up to ``until`` (default ``train.rounds``)."""
    state = on_device(state or prep.algorithm.init_state(prep.ctx), prep.ctx.data.train.x.device,
                      prep.algorithm.device_state_keys)
    if needs_pre_federation(prep, state):
        state = stages.pre_federation(prep, state)
        if on_pre_federation:
            on_pre_federation(state)
    for r in range(state.round, until if until is not None else prep.cfg.train.rounds):
        state, row = drive_round(prep, state, r, stages, on_cycle)
        if on_round:
            on_round(state, row)
    return state


def run_round(prep: PreparedRun, state: ServerState, round: int) -> tuple[ServerState, dict[str, Any]]:
    """One plain round (no orchestrator); runs the pre-federation step first if it is due."""
    if needs_pre_federation(prep, state):
        state = pre_federation_stage(prep, state)
    return drive_round(prep, state, round)


def run_rounds(prep: PreparedRun, state: Optional[ServerState] = None, until: Optional[int] = None,
               on_round: Optional[Callable[[ServerState, dict], None]] = None) -> ServerState:
    return drive(prep, state, PLAIN, until, on_round=on_round)
