"""Cells trained together (``flockfl sweep`` and ``flockfl repro`` by default; ``--no-stack`` runs
them one by one): :func:`run_stack` runs several runs' bodies as the cells of one
:class:`flockfl.engine.stacking.Stack` inside one Prefect flow, ``flockfl-stack``, whose tasks are
the stack's merged passes (``train_stack``). Each cell is a whole run as ``flockfl run`` makes it
(flows/experiment.py's body with the plain loop's stages): its own run directory, checkpoints and
MLflow child run, resumed from its own checkpoints; only its local training is shared.

Cells that cannot share a pass (another model, a per-client solver, the reference trainer) are
trained beside the others in the same flow. A cell on a Dask executor is not stacked (the sweep
runs it alone)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from prefect import flow
from prefect.utilities.annotations import quote as Q

import tasks
from flockfl.config import ExperimentConfig
from flockfl.engine.stacking import Stack
from flows.experiment import Steps, open_run_dir, run_body


@dataclass
class Cell:
    """One run of a stack: its config and run directory, and how it is tracked."""

    cfg: ExperimentConfig
    run_dir: Path
    run_name: Optional[str] = None
    run_tags: Optional[dict] = None
    summary: Optional[dict] = None
    error: Optional[BaseException] = None


def stackable(cfg: ExperimentConfig) -> bool:
    """Whether a run may be a cell of a stack (the Dask executor trains its shards elsewhere)."""
    return cfg.executor.kind != "dask"


_CELLS: dict[str, list[Cell]] = {}  # the flow's cells by key: the flow's parameters go to the Prefect API as JSON


@flow(name="flockfl-stack", persist_result=False, log_prints=False)
def stack_flow(key: str, partitions_root: str, tracking_uri: str, parent_run_id: Optional[str]) -> dict:
    """Every cell's run, its passes trained together; returns the stack's counts (each cell's
    summary or error is set on the cell)."""
    cells = _CELLS[key]
    stack = Stack(on_pass=lambda calls: tasks.train_stack(Q(calls)))
    jobs = [lambda c=c: run_body(c.cfg.model_dump(), str(c.run_dir), partitions_root, tracking_uri, False,
                                 parent_run_id, c.run_tags, c.run_name, Steps(plain=True)) for c in cells]
    for cell, (summary, err) in zip(cells, stack.run(jobs)):
        cell.summary, cell.error = summary, err
        if summary is not None:
            summary.pop("body_at", None)
    return {"passes": stack.passes, "calls": stack.calls}


def run_stack(cells: list[Cell], partitions_root: str, tracking_uri: str, parent_run_id: Optional[str] = None,
              fresh: Optional[list[bool]] = None) -> dict[str, Any]:
    """Run ``cells`` as one stack (each resumes from its checkpoints, a fresh one writes its
    run.json first); each cell's ``summary`` (its models still exporting: settle it,
    ``flows.run_tracking.settle``) or ``error`` is set. Returns the stack's counts and wall time."""
    from flows import apiserver
    from flows.tracking.store import prefetch

    if any(c.cfg.tracking.enabled for c in cells):
        prefetch(tracking_uri)
    for i, c in enumerate(cells):
        open_run_dir(c.cfg, c.run_dir, tracking_uri, partitions_root, fresh[i] if fresh else False)
    apiserver.wait_ready()
    t0 = time.perf_counter()
    key = f"{id(cells)}-{t0}"
    _CELLS[key] = cells
    try:
        counts = stack_flow.with_options(flow_run_name=f"stack of {len(cells)}")(key, partitions_root, tracking_uri,
                                                                                 parent_run_id)
    finally:
        _CELLS.pop(key, None)
    return {**counts, "wall_s": time.perf_counter() - t0}
