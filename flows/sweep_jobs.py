"""A sweep's jobs, as the sweep's own process and its worker processes (flows/sweep_workers.py)
run them: one run (:func:`run_one`) or a stack of cells trained together (:func:`run_stacked`),
each ending in its summary (its models still exporting: :func:`flows.run_tracking.settle`) or
its error; and a job as the JSON line a worker reads."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from flockfl.state import list_checkpoints
from flows.experiment import execute


@dataclass
class Job:
    """A stack of cells (``stack``) or one run: the children by key, and what running them needs."""

    id: int
    stack: bool
    children: list  # flows.sweep_plan.Child
    names: list[str]
    tags: list[dict]


def make_jobs(todo: list, parallel: int, stack: int, run_name, run_tags) -> list[Job]:
    """A sweep's children ``todo`` as jobs for ``parallel`` processes: the cells (flows/stack.py) in
    stacks of up to ``stack``, no larger than it takes for every process to get one; each other
    child (and a stack of one) a run of its own. ``run_name(child)``, ``run_tags(child)``: its MLflow run's."""
    from flows.stack import stackable

    cell = [stack > 1 and stackable(c.cfg) for c in todo]
    cells = [c for c, ok in zip(todo, cell) if ok]
    size = min(stack, math.ceil(len(cells) / parallel)) if cells else 1
    groups = [cells[a:a + size] for a in range(0, len(cells), size)] + [[c] for c, ok in zip(todo, cell) if not ok]
    return [Job(i, len(g) > 1, g, [run_name(c) for c in g], [run_tags(c) for c in g]) for i, g in enumerate(groups)]


def job_line(job: Job, uri: str, partitions_root: str, parent_run_id: Optional[str]) -> str:
    return json.dumps({"id": job.id, "stack": job.stack, "uri": uri, "partitions_root": partitions_root,
                       "parent_run_id": parent_run_id,
                       "children": [{"key": c.key, "config": c.cfg.model_dump(), "run_dir": str(c.run_dir), "name": n,
                                     "tags": t} for c, n, t in zip(job.children, job.names, job.tags)]}, default=str)


def error_text(err: BaseException) -> str:
    """How a sweep records a run's error: its type and the first line of its message."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


_WORKER = int(os.environ.get("FLOCKFL_SWEEP_WORKER", "0"))  # the process a run ran in: 0 the sweep's own, i its worker i


def run_one(child, name: str, tags: dict, partitions_root: str, uri: str, parent_run_id: Optional[str],
            progress: bool = False) -> tuple[Optional[dict], Optional[BaseException]]:
    """Run ``child`` (a :class:`Child`, or a worker's) up to its end, its models still exporting
    (:func:`flows.run_tracking.settle`): its summary, or the error that ended it."""
    t = time.perf_counter()
    try:
        summary = execute(child.cfg, child.run_dir, tracking_uri=uri, partitions_root=partitions_root,
                          fresh=not list_checkpoints(child.run_dir), progress=progress, parent_run_id=parent_run_id,
                          run_tags=tags, run_name=name, wait=False)
    except Exception as err:
        return None, err
    summary["sweep_wall_s"] = time.perf_counter() - t  # the run as the sweep saw it, set-up included
    summary["worker"] = _WORKER
    return summary, None


def run_stacked(chunk: list, names: list[str], tags: list[dict], partitions_root: str, uri: str,
                parent_run_id: Optional[str]) -> list[tuple[Optional[dict], Optional[BaseException]]]:
    """``chunk`` (children, a sweep's or a worker's) as the cells of one stack (flows/stack.py):
    each cell's summary (its models still exporting) or error. A cell's ``sweep_wall_s`` is its
    share of the stack's wall time; ``stack`` says what the stack saved. Raises if the stack
    itself failed."""
    from flows.stack import Cell, run_stack

    runs = [Cell(c.cfg, c.run_dir, n, t) for c, n, t in zip(chunk, names, tags)]
    info = run_stack(runs, partitions_root, uri, parent_run_id, fresh=[not list_checkpoints(c.run_dir) for c in chunk])
    rounds = max((r.summary["rounds_wall_s"] for r in runs if r.summary), default=0.0)
    for run in runs:
        if run.summary is not None and run.error is None:
            run.summary["sweep_wall_s"], run.summary["worker"] = info["wall_s"] / len(chunk), _WORKER
            run.summary["stack"] = {"cells": len(chunk), "passes": info["passes"], "calls": info["calls"],
                                    "wall_s": info["wall_s"], "fixed_s_per_cell": (info["wall_s"] - rounds) / len(chunk)}
    return [(r.summary if r.error is None else None, r.error) for r in runs]
