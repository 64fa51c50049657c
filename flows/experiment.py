"""The experiment flow: partition, restore, then rounds of select → train → cluster →
aggregate → evaluate → checkpoint/log.

Local training is mapped over shards of the cohort (each a vectorised batch of clients),
never one task per client. A failed shard is retried; if it still fails its clients are
trained one by one and the failing ones are dropped and recorded, and the round goes on.
"""

from __future__ import annotations

import sys
import time
import traceback
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote as Q

import tasks
from flockfl import cores, rounds, training
from flockfl.algorithms import auto
from flockfl.config import ExperimentConfig
from flockfl.engine import TrainResult
from flockfl.eval_summary import summarise
from flockfl.experiments import validate
from flockfl.state import ServerState
from flows.dask import DaskTraining, dask_cluster, dask_stage, shared_prefect_api
from flows.rundir import read_run_file, write_run_file
from flows.tracking.background import BackgroundTracker
from flows.tracking.store import prefetch
from flows.tracking.tracker import Tracker

class Progress:
    """A run's progress: a rich bar on stderr when stderr is a terminal, else one plain line per
    round (a log file reads as a log): on stdout, or on stderr under ``--json`` (whose stdout
    ends with the summary). Nothing with ``--no-progress``."""

    def __init__(self, total: int, start: int, name: str, enabled: bool, json_out: bool = False):
        self.bar = None
        self.stream = None
        self.total, self.name = total, name
        if not enabled:
            return
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task(name, total=total, completed=start, info="")
            self.bar.start()
        else:
            self.stream = sys.stderr if json_out else sys.stdout
        self.t = time.perf_counter()

    def update(self, row: dict) -> None:
        info = " ".join(f"{k}={row[k]:.3f}" for k in ("accuracy", "loss", "ari") if isinstance(row.get(k), float))
        if self.bar:
            self.bar.update(self.task, completed=row["round"], info=info)
        elif self.stream:
            now = time.perf_counter()
            clusters = f" clusters={row['num_clusters']}" if "num_clusters" in row else ""
            print(f"{time.strftime('%H:%M:%S')} {self.name} round {row['round']}/{self.total} {info}{clusters} "
                  f"{now - self.t:.2f}s", file=self.stream, flush=True)
            self.t = now

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


@contextmanager
def _timed(phases: dict, name: str):
    """Adds the block's wall time to ``phases[name]`` (``flockfl run --json``'s ``phases_s``)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t


def _heartbeats_without_join() -> None:
    """Flow runs end without waiting for Prefect's heartbeat thread.

    A flow run sends heartbeats from a daemon thread that sleeps in 1 s steps; at the end of
    every flow run the sync engine joins it, which waits for the current step: 0.5 s per run
    on average, for nothing (the thread exits by itself at its next step). The engine's own
    ``join_on_exit`` switch (what its async engine uses) is set instead. Heartbeats still
    run while the flow does. Left alone if Prefect's function no longer has that switch."""
    import functools
    import inspect

    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if send is None or getattr(send, "flockfl_no_join", False):
        return
    if "join_on_exit" not in inspect.signature(send).parameters:
        return

    @functools.wraps(send)
    def no_join(engine, join_on_exit: bool = True):
        return send(engine, join_on_exit=False)

    no_join.flockfl_no_join = True
    flow_engine._send_heartbeats = no_join


_heartbeats_without_join()


# runs whose tracking is still closing (the models exporting) after their flow returned:
# run_experiment waits for it (settle), or a sweep does while its next run goes on
_CLOSING: dict[str, tuple[BackgroundTracker, Optional[Future]]] = {}


def _key(run_dir) -> str:
    return str(Path(run_dir).resolve())


_LEASES: dict[str, cores.Lease] = {}  # run dir -> its core lease, queued by execute, waited for by the flow


def _request_cores(cfg: ExperimentConfig, run_dir) -> None:
    """Queue for the cores of this run's threads (``flockfl.cores``; not on CUDA) while it sets up."""
    import torch

    from flockfl.engine.runtime import resolve_threads

    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return
    lease = cores.request(resolve_threads(cfg.train.threads), f"flockfl run {cfg.name}")
    if lease:
        _LEASES[_key(run_dir)] = lease


def _wait_for_cores(run_dir, phases: dict) -> dict:
    lease = _LEASES.get(_key(run_dir))
    if lease is None:
        return {"cores_wait_s": 0.0, "cores_queued_s": 0.0, "cores_leased": []}
    with _timed(phases, "cores_wait"):
        waited = lease.wait()
    return {"cores_wait_s": waited, "cores_queued_s": lease.queued_s, "cores_leased": lease.granted}


def _release_cores(run_dir) -> None:
    lease = _LEASES.pop(_key(run_dir), None)
    if lease:
        lease.release()


def open_tracking(cfg: ExperimentConfig, run_dir: Path, uri: str, parent_run_id: Optional[str] = None,
                  run_tags: Optional[dict] = None, run_name: Optional[str] = None) -> Optional[BackgroundTracker]:
    """Start opening the run's MLflow run in the background: the one run.json names (a resumed
    run), else a new one, whose id goes into run.json as soon as it exists (before any
    checkpoint, so a killed run resumes into it)."""
    if not cfg.tracking.enabled:
        return None
    run_id = read_run_file(run_dir).get("mlflow_run_id")
    tags = {"flockfl.run_dir": str(run_dir.resolve()), "flockfl.config_sha256": cfg.digest(),
            "flockfl.algorithm": cfg.algorithm.name}
    notes = _notes(cfg)
    if notes:  # what the configuration makes of the method (k=1: FedAvg), beside its results
        tags["flockfl.notes"] = " | ".join(notes)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # a nested run (sweeps, comparisons)
    tags.update(run_tags or {})

    def record(t: Tracker) -> None:
        if run_id is None:
            write_run_file(run_dir, {**read_run_file(run_dir), "mlflow_run_id": t.run_id})

    return BackgroundTracker(uri, cfg.tracking.experiment or cfg.name, run_name or run_dir.name, run_id=run_id,
                             params=cfg.to_flat(), tags=tags, on_open=record)


def _notes(cfg: ExperimentConfig) -> list[str]:
    from flockfl.algorithms import ALGORITHMS

    return ALGORITHMS[cfg.algorithm.name].notes(cfg)


def task_stages(remote: Optional["DaskTraining"] = None) -> rounds.Stages:
    """The round's stages as Prefect tasks: the same functions the plain loop calls.

    In-memory values cross task boundaries wrapped in ``quote``: Prefect then skips walking
    them for futures (that traversal of states and histories cost ~10 ms per task). With
    ``remote`` (``executor.kind=dask``) only the training shards go to the Dask cluster; every
    other stage runs here, where the data is."""
    return rounds.Stages(
        pre_federation=lambda prep, state: tasks.pre_federation(Q(prep), Q(state)),
        select=remote.select if remote else (lambda prep, state, r: tasks.select(Q(prep), Q(state), r)),
        train=remote.train if remote else _train,
        cluster=lambda prep, state, spec, result: tasks.cluster(Q(prep), Q(state), Q(spec), Q(result)),
        aggregate=lambda prep, state, spec, result, assign, r: tasks.aggregate(Q(prep), Q(state), Q(spec), Q(result), Q(assign), r),
        evaluate=lambda prep, state, r: tasks.evaluate(Q(prep), Q(state), r),
    )


def _train(prep: rounds.PreparedRun, spec, engine: str, r: int) -> tuple[Optional[TrainResult], list[int]]:
    """The train stage as Prefect tasks: one ``train_shard`` task per shard (retried by Prefect),
    the shard loop of ``flockfl.training``."""
    cfg = prep.cfg.train
    train = tasks.train_shard.with_options(retries=cfg.max_retries, retry_delay_seconds=0)

    def run(shards):
        if cfg.parallel_shards > 1:
            futures = [train.submit(Q(prep), Q(shard), engine, r) for shard in shards]
            states = [f.wait() or f.state for f in futures]
        else:
            # one shard at a time, in this thread: torch's intra-op pool is warm here, and a
            # worker thread measured ~40% slower per step on 2 cores
            states = [train(Q(prep), Q(shard), engine, r, return_state=True) for shard in shards]
        return [st.result() if st.is_completed() else None for st in states]

    return training.shard_loop(spec, cfg.shard_size, run, lambda shard: tasks.isolate_failures(Q(prep), Q(shard), engine, r))


CHECKPOINT_ARTIFACT_MAX = 64 << 20  # a larger checkpoint (dense per-client state) is referenced, not copied


def checkpoint_reference(run_dir: Path, ckpt: Path, state_sha256: str) -> dict:
    """Where the run's full state lives: the checkpoint file and its per-client row store."""
    import hashlib

    rows = run_dir / "client_state"
    return {"run_dir": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()),
            "checkpoint_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest(), "state_sha256": state_sha256,
            "client_state_dir": str(rows.resolve()) if rows.is_dir() else None,
            "client_state_bytes": sum(f.stat().st_size for f in rows.rglob("*.row")) if rows.is_dir() else 0,
            "resume": f"flockfl resume {run_dir.resolve()}"}


def _mark_finished(run_dir: Path) -> None:
    write_run_file(run_dir, {**read_run_file(run_dir), "finished": True})


def _finalise(prep: rounds.PreparedRun, state: ServerState, run_dir: Path, tracker: Optional[BackgroundTracker],
              phases: Optional[dict] = None) -> Optional[Future]:
    """The run's end. Here: the plots and ``assignments.npz``. Then, queued on the tracking
    thread (so the models export while this process finishes the flow, or a sweep its next
    run), in this order: the artifacts, the models, the tags, run.json's ``finished`` mark and
    the FINISHED status. A kill anywhere in between leaves a run that ``flockfl resume`` finishes,
    exporting only the models it lacks. Returns that job (``{"model_versions", "models_s"}``),
    or None without tracking (then the run is marked finished here)."""
    from flockfl import plots

    phases = {} if phases is None else phases
    cfg = prep.cfg
    plot_dir = run_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    files = []
    with _timed(phases, "plots"):
        if cfg.tracking.plots and state.history:
            files.append(plots.accuracy_curves(state.history, plot_dir / "accuracy_curves.png"))
            files.append(plots.assignment_heatmap(state.assignment_history, prep.ctx.data.group,
                                                  plot_dir / "cluster_assignments.png"))
            # client × client matrices an algorithm keeps (PACFL's proximity, FLIS's similarity); rows
            # follow state.algo["matrix_clients"] when the matrix covers only some clients
            rows = state.algo.get("matrix_clients")
            groups = prep.ctx.data.group[rows.numpy()] if rows is not None else prep.ctx.data.group
            for name, m in (state.algo.get("matrices") or {}).items():
                files.append(plots.matrix_heatmap(m.numpy(), groups, name, plot_dir / f"{name}.png"))
        if cfg.tracking.plots and state.meta.get(auto.META_KEY):  # the evidence of algorithm.*=auto
            files.append(plots.auto_choice(state.meta[auto.META_KEY], plot_dir / "auto_choice.png"))
    # what `flockfl report` draws the assignment heat-maps from: cluster per client per round
    # (-1 = not assigned) and each client's true group (-1 = unknown)
    hist = np.asarray(state.assignment_history)
    dtype = np.int16 if hist.size == 0 or hist.max() < 32767 else np.int32
    assignments = run_dir / "assignments.npz"
    np.savez_compressed(assignments, history=hist.astype(dtype), groups=np.asarray(prep.ctx.data.group, np.int32))
    if not tracker:
        _mark_finished(run_dir)
        return None
    # what the job needs, taken now (it must not hold on to the prepared run: a sweep's next run is
    # loading meanwhile): the model template, the final tensors and one input example
    model, models, newcomers = prep.ctx.model, state.models, state.driver.newcomers
    choices = state.meta.get(auto.META_KEY)
    example = prep.ctx.data.train.x[:2].cpu().numpy()
    name = f"flockfl-{cfg.name}" if cfg.tracking.register_model else None
    digest = state.digest()
    tags = {"flockfl.engine": state.driver.engine or "", "flockfl.engine_reason": state.driver.engine_reason or "",
            "flockfl.partition_sha256": prep.partition_hash, "flockfl.state_sha256": digest}

    def close(t: Tracker) -> dict:
        try:
            t.log_artifact(assignments)
            for f in files:
                t.log_artifact(f, "plots")
            if newcomers is not None:
                t.log_dict(newcomers, "newcomers.json")
            if choices:
                t.log_dict({"decisions": choices}, "auto_choices.json")
            ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))
            if ckpts:  # per-client rows stay in the run directory: MLflow gets a reference, not a copy
                t.log_dict(checkpoint_reference(run_dir, ckpts[-1], digest), "checkpoint/reference.json")
                if ckpts[-1].stat().st_size <= CHECKPOINT_ARTIFACT_MAX:
                    t.log_artifact(ckpts[-1], "checkpoint")
            t0 = time.perf_counter()
            versions = t.log_models(model, models, name, example, cfg.tracking.model_format)
            models_s = time.perf_counter() - t0
            t.set_tags(tags)
            _mark_finished(run_dir)
            t.finish("FINISHED")
            return {"model_versions": versions, "models_s": models_s}
        except BaseException:
            (run_dir / "error.log").write_text(traceback.format_exc())
            t.finish("FAILED")
            raise

    return tracker.submit(close, "close")


@flow(name="flockfl-experiment", persist_result=False, log_prints=False)
def experiment_flow(config: dict, run_dir: str, partitions_root: str = "data/partitions",
                    tracking_uri: str = "sqlite:///mlflow.db", progress: Union[bool, str] = True,
                    parent_run_id: Optional[str] = None, run_tags: Optional[dict] = None,
                    run_name: Optional[str] = None) -> dict:
    """Run (or continue) one experiment; returns the summary that ``flockfl run --json`` prints.

    The rounds are :func:`flockfl.rounds.drive` with task-wrapped stages (:func:`task_stages`);
    each round is then checkpointed and logged.
    """
    t_start = time.perf_counter()
    cfg = validate(config)
    run_path = Path(run_dir)
    phases: dict[str, float] = {}
    with _timed(phases, "partition"):
        prep = tasks.partition(cfg, partitions_root)
    remote = dask_stage(prep, partitions_root) if cfg.executor.kind == "dask" else None
    with _timed(phases, "restore"):
        state, warnings = tasks.restore(Q(prep), run_dir)
    resumed_from = state.round
    with _timed(phases, "tracker"):  # the MLflow run is created in the background (MLflow and the
        # store were loaded in the background since execute/run_experiment: prefetch)
        tracker = open_tracking(cfg, run_path, tracking_uri, parent_run_id, run_tags, run_name)
    if tracker:  # the partition's measures on a new run; the rounds a killed run never logged
        tracker.catch_up({f"partition_{k}": v for k, v in (prep.info.get("heterogeneity") or {}).items()
                          if isinstance(v, (int, float))}, [dict(h) for h in state.history])
    bar = Progress(cfg.train.rounds, state.round, cfg.name, bool(progress), json_out=progress == "stderr")
    periods, overhead = [], []
    clock = {"t0": time.perf_counter(), "body0": tasks.BODY_SECONDS[0]}

    def save(st: ServerState) -> None:
        if tracker:  # the MLflow run a resume continues (waits for it to exist: by now it does)
            tracker.check()  # a failed log fails the run here, not at its end
            st.driver.mlflow_run_id = tracker.run_id
        tasks.checkpoint(Q(st), run_dir, cfg.train.checkpoints_to_keep)

    def after_pre_federation(st: ServerState) -> None:
        save(st)  # resume never redoes it
        if tracker:
            tracker.log_pre_federation(st.driver.pre_federation)
            for rec in st.meta.get(auto.META_KEY, []):  # a threshold chosen before round 0 (algorithm.*=auto)
                tracker.log_values(auto.metrics(rec), step=0)
        phases["pre_federation"] = time.perf_counter() - clock["drive0"]  # the algorithm's one-shot step
        clock.update(t0=time.perf_counter(), body0=tasks.BODY_SECONDS[0])

    def after_cycle(st: ServerState) -> None:  # mid-round (FedCluster's cycles): resume starts at the next cycle
        save(st)

    def after_round(st: ServerState, row: dict) -> None:
        if remote:  # the round's traffic between this process and the workers (row is st.history[-1])
            row.update(remote.take_counts())
        save(st)
        if tracker:
            tasks.log_metrics(Q(tracker), Q([row]))
        bar.update(row)
        now = time.perf_counter()
        periods.append(now - clock["t0"])
        # what the round cost beyond the task bodies: Prefect's task machinery plus the
        # flow's own bookkeeping (engine lookup, history row, progress bar)
        overhead.append(periods[-1] - (tasks.BODY_SECONDS[0] - clock["body0"]))
        clock.update(t0=now, body0=tasks.BODY_SECONDS[0])

    leased = _wait_for_cores(run_path, phases)  # the rounds start once this run's cores are free
    try:
        with _timed(phases, "drive"):
            clock["drive0"] = clock["t0"] = time.perf_counter()
            state = rounds.drive(prep, state, task_stages(remote), on_pre_federation=after_pre_federation,
                                 on_round=after_round, on_cycle=after_cycle)
        bar.close()
        # a resume of a run that had already finished must not register its models again
        with _timed(phases, "finalise"):
            if resumed_from >= cfg.train.rounds and read_run_file(run_path).get("finished"):
                closing = tracker.finish("FINISHED") if tracker else None
            else:
                closing = _finalise(prep, state, run_path, tracker, phases)
    except BaseException:
        bar.close()
        (run_path / "error.log").write_text(traceback.format_exc())
        if tracker:
            tracker.finish("FAILED")
            tracker.close(raise_errors=False)
        raise
    finally:
        _release_cores(run_path)
    if tracker:
        _CLOSING[_key(run_path)] = (tracker, closing)
    summary = summarise(state, cfg.train.target_accuracy)
    timed = periods[1:] or periods
    out = {
        "run_id": tracker.run_id if tracker else None,
        "run_dir": str(run_path),
        "experiment": cfg.name,
        "algorithm": cfg.algorithm.name,
        "mlflow_experiment": cfg.tracking.experiment or cfg.name,
        **({"notes": _notes(cfg)} if _notes(cfg) else {}),
        "rounds": state.round,
        "resumed_from_round": resumed_from,
        "metrics": summary["metrics"],
        "state_sha256": state.digest(),
        "wall_s": time.perf_counter() - t_start,
        # the rounds this process ran (checkpoints and logging included) and the algorithm's one-shot
        # pre-federation step: the run's compute; what the process spends beyond it is fixed cost
        "rounds_wall_s": float(sum(periods)) + phases.get("pre_federation", 0.0),
        "phases_s": phases,  # where the flow's time went (drive includes the rounds)
        "round_s_median": float(np.median(timed)) if timed else float("nan"),
        "compute_round_s_median": summary["round_s_median"],
        **{k: summary[k] for k in ("target_accuracy", "rounds_to_target", "sim_time_to_target", "protocol", "reports")
           if k in summary},
        "orchestration_ms_median": float(np.median(overhead[1:] or overhead)) * 1000 if overhead else float("nan"),
        "engine": state.driver.engine,
        "engine_reason": state.driver.engine_reason,
        "threads": prep.threads,
        # the core lease (flockfl.cores): cores_wait_s, how long the rounds waited for this run's cores;
        # cores_queued_s, from the request (set-up went on meanwhile) to the grant; cores_leased, their CPU ids
        **leased,
        "partition": str(prep.partition_path),
        "partition_sha256": prep.partition_hash,
        "partition_cached": prep.partition_cached,
        "checkpoint_warnings": warnings,
        "executor": cfg.executor.kind,
        **(_executor_summary(state.history) if remote else {}),
        "clients_dropped": int(sum(h.get("clients_dropped", 0) for h in state.history)),
        # every byte sent: the rounds' transfers plus the one-shot pre-federation upload/download
        "bytes_total": int(sum(h.get("bytes_total", 0) for h in state.history)
                           + sum(v for k, v in (state.driver.pre_federation or {}).items() if k.startswith("bytes"))),
        **({"pre_federation": state.driver.pre_federation} if state.driver.pre_federation is not None else {}),
        **({"newcomers": state.driver.newcomers} if state.driver.newcomers is not None else {}),
        **({"auto": auto.summary(state.meta)} if auto.META_KEY in state.meta else {}),
    }
    out["body_at"] = (t_start, time.perf_counter())  # for run_experiment's flow_start / flow_end phases
    return out


def _executor_summary(history: list[dict]) -> dict:
    """Per-round medians of the traffic between the flow and the Dask workers."""
    keys = ("executor_bytes_to_workers", "executor_bytes_from_workers")
    rows = [h for h in history if keys[0] in h]
    out = {f"{k}_median": float(np.median([h[k] for h in rows])) if rows else float("nan") for k in keys}
    out["executor_shards_local"] = int(sum(h.get("executor_shards_local", 0) for h in rows))
    return out


def run_experiment(cfg: ExperimentConfig, run_dir: Path, partitions_root: str, tracking_uri: str,
                   progress: Union[bool, str] = True, parent_run_id: Optional[str] = None, run_tags: Optional[dict] = None,
                   run_name: Optional[str] = None, wait: bool = True) -> dict:
    """Run the flow with a thread pool sized for the shards (one at a time on small machines),
    or with ``executor.kind=dask`` on a DaskTaskRunner (the scheduler at ``executor.address``, or
    a LocalCluster started and closed here).

    ``wait=False`` returns as soon as the rounds and plots are done, while the run's tracking
    closes in the background (the models export); :func:`settle` then waits for it and adds
    ``model_versions`` to the summary. A sweep settles each run while the next one goes on."""
    from flows import apiserver

    if cfg.tracking.enabled:
        prefetch(tracking_uri)
    t_api = time.perf_counter()
    apiserver.wait_ready()  # the per-process API flockfl started first thing (no-op otherwise)
    args = (cfg.model_dump(), str(run_dir), partitions_root, tracking_uri, progress, parent_run_id, run_tags, run_name)
    flow_run_name = run_name or cfg.name
    t_call = time.perf_counter()
    try:
        if cfg.executor.kind == "dask":
            from prefect_dask import DaskTaskRunner

            with dask_cluster(cfg.executor) as address, shared_prefect_api(address):
                runner = DaskTaskRunner(address=address, client_kwargs={"timeout": f"{cfg.executor.connect_timeout_s}s"})
                summary = experiment_flow.with_options(task_runner=runner, flow_run_name=flow_run_name)(*args)
        else:
            runner = ThreadPoolTaskRunner(max_workers=max(1, cfg.train.parallel_shards))
            summary = experiment_flow.with_options(task_runner=runner, flow_run_name=flow_run_name)(*args)
    except BaseException:
        pending = _CLOSING.pop(_key(run_dir), None)  # the flow failed after its rounds: nothing waits for it
        if pending:
            pending[0].close(raise_errors=False)
        raise
    # Prefect's own time around the flow body: waiting for the API, creating the flow run, ending it
    started, ended = summary.pop("body_at")
    summary["phases_s"].update(api_wait=t_call - t_api, flow_start=started - t_call, flow_end=time.perf_counter() - ended)
    return settle(summary) if wait else summary


def settle(summary: dict) -> dict:
    """Wait until the run's tracking is closed (artifacts, models, FINISHED) and complete its
    summary: ``model_versions`` and ``tracking_s`` (what the tracking thread spent, off the
    run's path: opening the run, ``models``, …) and ``phases_s["close_wait"]`` (how long this
    waited for it). Re-raises a failure of the tracking (the run is then FAILED, with its
    error.log, and ``flockfl resume`` finishes it). A no-op for a run without tracking."""
    pending = _CLOSING.pop(_key(summary["run_dir"]), None)
    if pending is None:
        return summary
    tracker, closing = pending
    t = time.perf_counter()
    try:
        tracker.close()
        done = closing.result() if isinstance(closing, Future) else None
    finally:
        summary.setdefault("phases_s", {})["close_wait"] = time.perf_counter() - t
        summary["tracking_s"] = dict(tracker.seconds)
    if isinstance(done, dict):
        summary["model_versions"] = done["model_versions"]
        summary["tracking_s"]["models"] = done["models_s"]
    return summary


def execute(cfg: ExperimentConfig, run_dir: Path, *, tracking_uri: Optional[str], partitions_root: str, fresh: bool,
            progress: Union[bool, str] = True, metrics_file: Optional[str] = None, parent_run_id: Optional[str] = None,
            run_tags: Optional[dict] = None, run_name: Optional[str] = None, wait: bool = True) -> dict:
    """Run or resume ``cfg`` in ``run_dir``: what ``flockfl run``, ``flockfl resume``, a sweep's
    child and a scheduled run all do. A fresh run first builds its partition (before the flow:
    data errors are one line) and writes run.json; the metrics also go to ``metrics_file``
    (for DVC) when given here or in run.json. ``wait``: see :func:`run_experiment`."""
    import datetime as dt
    import json

    from flockfl.data.store import build_partition
    from flows.tracking.store import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri, cfg.tracking.uri)
    if cfg.tracking.enabled:
        prefetch(uri)  # MLflow imports and opens its store while the partition builds
    info = read_run_file(run_dir)
    if fresh or "config" not in info:
        build_partition(cfg, partitions_root)
        run_dir.mkdir(parents=True, exist_ok=True)
        info.update({"config": cfg.model_dump(), "tracking_uri": uri, "partitions_root": str(Path(partitions_root).resolve()),
                     "metrics_file": metrics_file, "created": dt.datetime.now().isoformat()})
        write_run_file(run_dir, info)
    _request_cores(cfg, run_dir)  # in line for the cores while Prefect, the data and the model set up
    try:
        summary = run_experiment(cfg, run_dir, info.get("partitions_root", partitions_root), uri, progress=progress,
                                 parent_run_id=parent_run_id, run_tags=run_tags, run_name=run_name, wait=wait)
    finally:
        _release_cores(run_dir)
    if info.get("metrics_file") or metrics_file:
        path = Path(info.get("metrics_file") or metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rounds": summary["rounds"], **summary["metrics"],
                                    "round_s_median": summary["round_s_median"]}, indent=1, sort_keys=True))
    summary["tracking_uri"] = uri
    return summary
