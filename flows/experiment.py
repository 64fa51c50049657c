"""The experiment flow: partition, restore, then rounds of select → train → cluster →
aggregate → evaluate → checkpoint/log.

Local training is mapped over shards of the cohort (each a vectorised batch of clients),
never one task per client. A failed shard is retried; if it still fails its clients are
trained one by one and the failing ones are dropped and recorded, and the round goes on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import numpy as np
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote as Q

import tasks
from flockfl import rounds
from flockfl.config import ExperimentConfig, validate
from flockfl.engine import TrainResult
from flockfl.state import ServerState
from tasks.tracking import Tracker

RUN_FILE = "run.json"


def read_run_file(run_dir: Path) -> dict:
    p = Path(run_dir) / RUN_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def write_run_file(run_dir: Path, info: dict) -> None:
    from flockfl.state import atomic_write

    atomic_write(Path(run_dir) / RUN_FILE, json.dumps(info, indent=1, sort_keys=True).encode())


class Progress:
    """A rich progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, start: int, name: str, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task(name, total=total, completed=start, info="")
            self.bar.start()

    def update(self, row: dict) -> None:
        if self.bar:
            info = " ".join(f"{k}={row[k]:.3f}" for k in ("accuracy", "loss", "ari") if k in row)
            self.bar.update(self.task, completed=row["round"], info=info)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def _open_tracker(cfg: ExperimentConfig, state: ServerState, run_dir: Path, uri: str,
                  parent_run_id: Optional[str] = None) -> Optional[Tracker]:
    if not cfg.tracking.enabled:
        return None
    info = read_run_file(run_dir)
    run_id = state.meta.get("mlflow_run_id") or info.get("mlflow_run_id")
    tags = {"flockfl.run_dir": str(run_dir.resolve()), "flockfl.config_sha256": cfg.digest()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # a nested run (sweeps, comparisons)
    tracker = Tracker(uri, cfg.tracking.experiment or cfg.name, run_dir.name, run_id=run_id,
                      params=cfg.to_flat(), tags=tags)
    if run_id is None:
        info["mlflow_run_id"] = tracker.run_id
        write_run_file(run_dir, info)
    state.meta["mlflow_run_id"] = tracker.run_id
    return tracker


def task_stages() -> rounds.Stages:
    """The round's stages as Prefect tasks: the same functions the plain loop calls.

    In-memory values cross task boundaries wrapped in ``quote``: Prefect then skips walking
    them for futures (that traversal of states and histories cost ~10 ms per task)."""
    return rounds.Stages(
        pre_federation=lambda prep, state: tasks.pre_federation(Q(prep), Q(state)),
        select=lambda prep, state, r: tasks.select(Q(prep), Q(state), r),
        train=_train,
        cluster=lambda prep, state, spec, result: tasks.cluster(Q(prep), Q(state), Q(spec), Q(result)),
        aggregate=lambda prep, state, spec, result, assign, r: tasks.aggregate(Q(prep), Q(state), Q(spec), Q(result), Q(assign), r),
        evaluate=lambda prep, state, r: tasks.evaluate(Q(prep), Q(state), r),
    )


def _train(prep: rounds.PreparedRun, spec, engine: str, r: int) -> tuple[Optional[TrainResult], list[int]]:
    cfg = prep.cfg.train
    shards = rounds.split_spec(spec, cfg.shard_size)
    train = tasks.train_shard.with_options(retries=cfg.max_retries, retry_delay_seconds=0)
    if cfg.parallel_shards > 1:
        futures = [train.submit(Q(prep), Q(shard), engine, r) for shard in shards]
        states = [f.wait() or f.state for f in futures]
    else:
        # one shard at a time, in this thread: torch's intra-op pool is warm here, and a
        # worker thread measured ~40% slower per step on 2 cores
        states = [train(Q(prep), Q(shard), engine, r, return_state=True) for shard in shards]
    parts, dropped = [], []
    for shard, st in zip(shards, states):
        if st.is_completed():
            parts.append(st.result())
        else:
            part, lost = tasks.isolate_failures(Q(prep), Q(shard), engine, r)
            parts += [part] if part is not None else []
            dropped += lost
    return (TrainResult.concat(parts) if parts else None), dropped


CHECKPOINT_ARTIFACT_MAX = 64 << 20  # a larger checkpoint (dense per-client state) is referenced, not copied


def checkpoint_reference(run_dir: Path, ckpt: Path, state: ServerState) -> dict:
    """Where the run's full state lives: the checkpoint file and its per-client row store."""
    import hashlib

    rows = run_dir / "client_state"
    return {"run_dir": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()),
            "checkpoint_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest(), "state_sha256": state.digest(),
            "client_state_dir": str(rows.resolve()) if rows.is_dir() else None,
            "client_state_bytes": sum(f.stat().st_size for f in rows.rglob("*.row")) if rows.is_dir() else 0,
            "resume": f"flock resume {run_dir.resolve()}"}


def _finalise(prep: rounds.PreparedRun, state: ServerState, run_dir: Path, tracker: Optional[Tracker]) -> dict:
    from flockfl import plots

    cfg = prep.cfg
    out: dict[str, Any] = {}
    plot_dir = run_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    files = []
    if cfg.tracking.plots and state.history:
        files.append(plots.accuracy_curves(state.history, plot_dir / "accuracy_curves.png"))
        files.append(plots.assignment_heatmap(state.assignment_history, prep.ctx.data.group, plot_dir / "cluster_assignments.png"))
        # client × client matrices an algorithm keeps (PACFL's proximity, FLIS's similarity); rows
        # follow state.algo["matrix_clients"] when the matrix covers only some clients
        rows = state.algo.get("matrix_clients")
        groups = prep.ctx.data.group[rows.numpy()] if rows is not None else prep.ctx.data.group
        for name, m in (state.algo.get("matrices") or {}).items():
            files.append(plots.matrix_heatmap(m.numpy(), groups, name, plot_dir / f"{name}.png"))
    if tracker:
        for f in files:
            tracker.log_artifact(f, "plots")
        if "newcomers" in state.meta:
            tracker.log_dict(state.meta["newcomers"], "newcomers.json")
        ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))
        if ckpts:  # per-client rows stay in the run directory: MLflow gets a reference, not a copy
            tracker.log_dict(checkpoint_reference(run_dir, ckpts[-1], state), "checkpoint/reference.json")
            if ckpts[-1].stat().st_size <= CHECKPOINT_ARTIFACT_MAX:
                tracker.log_artifact(ckpts[-1], "checkpoint")
        name = f"flockfl-{cfg.name}" if cfg.tracking.register_model else None
        example = prep.ctx.data.train.x[:2].cpu().numpy()
        out["model_versions"] = tracker.log_models(prep.ctx.model, state.models, name, example)
        tracker.set_tags({"flockfl.engine": state.meta.get("engine", ""),
                          "flockfl.engine_reason": state.meta.get("engine_reason", ""),
                          "flockfl.partition_sha256": prep.partition_hash,
                          "flockfl.state_sha256": state.digest()})
    return out


@flow(name="flockfl-experiment", persist_result=False, log_prints=False)
def experiment_flow(config: dict, run_dir: str, partitions_root: str = "data/partitions",
                    tracking_uri: str = "sqlite:///mlflow.db", progress: bool = True,
                    parent_run_id: Optional[str] = None) -> dict:
    """Run (or continue) one experiment; returns the summary that ``flock run --json`` prints.

    The rounds are :func:`flockfl.rounds.drive` with task-wrapped stages (:func:`task_stages`);
    each round is then checkpointed and logged.
    """
    t_start = time.perf_counter()
    cfg = validate(config)
    run_path = Path(run_dir)
    prep = tasks.partition(cfg, partitions_root)
    state, warnings = tasks.restore(Q(prep), run_dir)
    resumed_from = state.round
    tracker = _open_tracker(cfg, state, run_path, tracking_uri, parent_run_id)
    logged = tracker.last_logged_round() if tracker else 0
    if tracker and logged == 0 and prep.info.get("heterogeneity"):  # the partition's heterogeneity measures
        tracker.log_values({f"partition_{k}": v for k, v in prep.info["heterogeneity"].items()
                            if isinstance(v, (int, float))}, step=0)
    if tracker and logged < state.round:  # a resumed run: log the rounds the crash kept from MLflow
        tasks.log_metrics(Q(tracker), [h for h in state.history if h["round"] > logged])
    bar = Progress(cfg.train.rounds, state.round, cfg.name, progress)
    periods, overhead = [], []
    clock = {"t0": time.perf_counter(), "body0": tasks.BODY_SECONDS[0]}

    def after_pre_federation(st: ServerState) -> None:
        tasks.checkpoint(Q(st), run_dir, cfg.train.checkpoints_to_keep)  # resume never redoes it
        if tracker:
            tracker.log_pre_federation(st.meta["pre_federation"])
        clock.update(t0=time.perf_counter(), body0=tasks.BODY_SECONDS[0])

    def after_cycle(st: ServerState) -> None:  # mid-round (FedCluster's cycles): resume starts at the next cycle
        tasks.checkpoint(Q(st), run_dir, cfg.train.checkpoints_to_keep)

    def after_round(st: ServerState, row: dict) -> None:
        tasks.checkpoint(Q(st), run_dir, cfg.train.checkpoints_to_keep)
        if tracker and row["round"] > logged:  # after a fallback to an older checkpoint, a
            tasks.log_metrics(Q(tracker), Q([row]))  # recomputed round was logged already
        bar.update(row)
        now = time.perf_counter()
        periods.append(now - clock["t0"])
        # what the round cost beyond the task bodies: Prefect's task machinery plus the
        # flow's own bookkeeping (engine lookup, history row, progress bar)
        overhead.append(periods[-1] - (tasks.BODY_SECONDS[0] - clock["body0"]))
        clock.update(t0=now, body0=tasks.BODY_SECONDS[0])

    try:
        state = rounds.drive(prep, state, task_stages(), on_pre_federation=after_pre_federation, on_round=after_round,
                             on_cycle=after_cycle)
        bar.close()
        info = read_run_file(run_path)
        # a resume of a run that had already finished must not register its models again
        extra = {} if resumed_from >= cfg.train.rounds and info.get("finished") else _finalise(prep, state, run_path, tracker)
        info["finished"] = True
        write_run_file(run_path, info)
    except BaseException:
        bar.close()
        (run_path / "error.log").write_text(traceback.format_exc())
        if tracker:
            tracker.finish("FAILED")
        raise
    if tracker:
        tracker.finish("FINISHED")
    summary = rounds.summarise(state, cfg.train.target_accuracy)
    timed = periods[1:] or periods
    return {
        "run_id": tracker.run_id if tracker else None,
        "run_dir": str(run_path),
        "experiment": cfg.name,
        "rounds": state.round,
        "resumed_from_round": resumed_from,
        "metrics": summary["metrics"],
        "state_sha256": state.digest(),
        "wall_s": time.perf_counter() - t_start,
        "round_s_median": float(np.median(timed)) if timed else float("nan"),
        "compute_round_s_median": summary["round_s_median"],
        **{k: summary[k] for k in ("target_accuracy", "rounds_to_target", "sim_time_to_target") if k in summary},
        "orchestration_ms_median": float(np.median(overhead[1:] or overhead)) * 1000 if overhead else float("nan"),
        "engine": state.meta.get("engine"),
        "engine_reason": state.meta.get("engine_reason"),
        "threads": prep.threads,
        "partition": str(prep.partition_path),
        "partition_sha256": prep.partition_hash,
        "partition_cached": prep.partition_cached,
        "checkpoint_warnings": warnings,
        "clients_dropped": int(sum(h.get("clients_dropped", 0) for h in state.history)),
        # every byte sent: the rounds' transfers plus the one-shot pre-federation upload/download
        "bytes_total": int(sum(h.get("bytes_total", 0) for h in state.history)
                           + sum(v for k, v in state.meta.get("pre_federation", {}).items() if k.startswith("bytes"))),
        **({"pre_federation": state.meta["pre_federation"]} if "pre_federation" in state.meta else {}),
        **({"newcomers": state.meta["newcomers"]} if "newcomers" in state.meta else {}),
        **extra,
    }


def run_experiment(cfg: ExperimentConfig, run_dir: Path, partitions_root: str, tracking_uri: str,
                   progress: bool = True, parent_run_id: Optional[str] = None) -> dict:
    """Run the flow with a thread pool sized for the shards (one at a time on small machines)."""
    runner = ThreadPoolTaskRunner(max_workers=max(1, cfg.train.parallel_shards))
    return experiment_flow.with_options(task_runner=runner, flow_run_name=cfg.name)(
        cfg.model_dump(), str(run_dir), partitions_root, tracking_uri, progress, parent_run_id)
