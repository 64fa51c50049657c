"""A run's MLflow run, from opening to closing, and the files of its end: :func:`open_tracking`
opens (or, on a resume, reopens) it in the background as the flow starts; :func:`finalise`
draws the plots and writes ``assignments.npz``, then queues the artifacts, the models, the
tags, run.json's ``finished`` mark and the FINISHED status on the tracking thread;
:func:`settle` waits for that and completes the summary. ``CLOSING`` holds the runs still
closing after their flow returned."""

from __future__ import annotations

import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import numpy as np

from flockfl import rounds
from flockfl.algorithms import auto
from flockfl.config import ExperimentConfig
from flockfl.state import ServerState
from flows.run_clock import timed
from flows.run_summary import method_notes
from flows.rundir import read_run_file, run_key, write_run_file
from flows.tracking.background import BackgroundTracker
from flows.tracking.tracker import Tracker

# runs whose tracking is still closing (the models exporting) after their flow returned:
# run_experiment waits for it (settle), or a sweep does while its next run goes on
CLOSING: dict[str, tuple[BackgroundTracker, Optional[Future]]] = {}


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
    notes = method_notes(cfg)
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


def finalise(prep: rounds.PreparedRun, state: ServerState, run_dir: Path, tracker: Optional[BackgroundTracker],
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
    with timed(phases, "plots"):
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


def settle(summary: dict) -> dict:
    """Wait until the run's tracking is closed (artifacts, models, FINISHED) and complete its
    summary: ``model_versions`` and ``tracking_s`` (what the tracking thread spent, off the
    run's path: opening the run, ``models``, …) and ``phases_s["close_wait"]`` (how long this
    waited for it). Re-raises a failure of the tracking (the run is then FAILED, with its
    error.log, and ``flockfl resume`` finishes it). A no-op for a run without tracking."""
    pending = CLOSING.pop(run_key(summary["run_dir"]), None)
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
