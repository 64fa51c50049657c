"""Running a sweep (:func:`run_sweep`), step by step: its folder and ``sweep.json`` (which runs it
has, how each ended, what the table needs of its summary; written at every change), the
children's run directories and partitions, the MLflow parent run, then the runs: one after
another, each one's models exporting while the next runs, in stacks of cells trained together, and
``--parallel`` processes at a time (flows/sweep_workers.py). A run
that fails is recorded and the sweep goes on; Ctrl-C stops the sweep, and running it again
continues it. Its result's JSON summary: :func:`sweep_summary`."""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from flockfl.data.store import build_partition
from flockfl.errors import UserError
from flockfl.state import list_checkpoints
from flows.interrupt import interrupted, sigint_seen, watch
from flows.run_tracking import settle
from flows.rundir import read_run_file
from flows.sweep_plan import STACK_SIZE, Child, Plan
from flows.sweep_table import aggregate, sweep_table
from flows.sweep_jobs import error_text, make_jobs, run_one, run_stacked
from flows.sweep_workers import Workers
from flows.tracking.store import resolve_tracking_uri
from flows.tracking.tracker import Tracker

SWEEP_FILE = "sweep.json"


@dataclass
class SweepResult:
    plan: Plan
    sweep_dir: Path
    parent_run_id: Optional[str]
    tracking_uri: str
    wall_s: float
    continued: bool

    @property
    def failed(self) -> list[Child]:
        return [c for c in self.plan.children if c.status == "failed"]


def run_sweep(plan: Plan, sweep_dir: Optional[Path] = None, tracking_uri: Optional[str] = None,
              partitions_root: str = "data/partitions", parallel: int = 1, parent_name: Optional[str] = None,
              experiment: Optional[str] = None, register_models: bool = False, progress: bool = False,
              log=lambda msg: print(msg, file=sys.stderr, flush=True), on_finished=None,
              stack: int = STACK_SIZE) -> SweepResult:
    """Run (or continue) every child of ``plan`` in this process; see flows/sweep.py's docstring.
    ``on_finished(child)`` is called, from the thread that settled it, as each child this call
    runs finishes (``flockfl repro``'s time estimate). ``stack``: children trained together, up to
    this many at a time (flows/stack.py); 0 runs them one by one. ``parallel``: processes (flows/sweep_workers.py)."""
    t0 = time.perf_counter()
    base = plan.base
    name = f"sweep-{base.name}-{plan.digest[:10]}"
    sweep_dir = Path(sweep_dir or Path("runs") / name)
    state = _state(sweep_dir, plan)
    continued = bool(state)
    uri = state.get("tracking_uri") or resolve_tracking_uri(tracking_uri, base.tracking.uri)
    experiment = experiment or base.tracking.experiment or base.name
    _prepare_children(plan, sweep_dir, experiment, register_models, partitions_root)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    parent = _open_parent(plan, sweep_dir, state, uri, experiment, parent_name or name)
    state.update({"digest": plan.digest, "experiment": base.name, "grid": plan.grid, "seeds": plan.seeds,
                  "tracking_uri": uri, "parent_run_id": parent.run_id if parent else None,
                  "partitions_root": str(Path(partitions_root).resolve()),
                  "created": state.get("created") or dt.datetime.now().isoformat()})
    sweep = _Sweep(plan, sweep_dir, state, uri, parent, partitions_root, progress, log, on_finished)
    todo = sweep.todo()
    if continued:
        log(f"sweep: continuing {sweep_dir}: {len(plan.children) - len(todo)} of {len(plan.children)} runs finished, "
            f"{sum(c.resumed for c in todo)} resume from checkpoints")
    else:
        log(f"sweep: {len(plan.children)} runs in {sweep_dir}" + (f", MLflow parent run {parent.run_id}" if parent else ""))
    sweep.run(todo, parallel, stack)
    result = SweepResult(plan, sweep_dir, parent.run_id if parent else None, uri, time.perf_counter() - t0, continued)
    if parent:
        _close_parent(parent, result)
    return result


def sweep_summary(result: SweepResult) -> dict:
    children = result.plan.children
    done = [c for c in children if c.status == "finished" and c.summary]
    fresh = [c.summary for c in done if c.summary.get("rounds_wall_s") is not None and "sweep_wall_s" in c.summary]
    return {
        "sweep_dir": str(result.sweep_dir), "parent_run_id": result.parent_run_id, "tracking_uri": result.tracking_uri,
        "digest": result.plan.digest, "runs": len(children), "finished": len(done), "failed": len(result.failed),
        "continued": result.continued, "wall_s": result.wall_s,
        # what a run costs beyond its rounds inside the sweep (flow start, tracking, partition, models, plots)
        "fixed_s_per_run_median": (statistics.median([_fixed(s) for s in fresh]) if fresh else None),
        "combinations": aggregate(result.plan),
        "children": {c.key: {"label": c.label, "seed": c.seed, "status": c.status, "error": c.error,
                             "run_dir": str(c.run_dir), "run_id": (c.summary or {}).get("run_id"),
                             "state_sha256": (c.summary or {}).get("state_sha256")} for c in children},
    }


def _fixed(summary: dict) -> float:
    """A run's time outside its rounds; a stacked cell's share of its stack's (the stack's wall time
    less its cells' rounds, which interleave: the longest of them)."""
    stack = summary.get("stack")
    return stack["fixed_s_per_cell"] if stack else summary["sweep_wall_s"] - summary["rounds_wall_s"]


def _state(sweep_dir: Path, plan: Plan) -> dict:
    """What sweep.json holds ({} for a new sweep); a folder of another sweep is refused."""
    state = _read(sweep_dir)
    if state and state.get("digest") != plan.digest:
        raise UserError(f"{sweep_dir} holds another sweep (different experiment, grid or seeds); "
                        f"choose another folder (flockfl sweep --sweep-dir, flockfl repro --out) or remove it")
    return state


def _prepare_children(plan: Plan, sweep_dir: Path, experiment: str, register_models: bool, partitions_root: str) -> None:
    """Each child's run directory in the sweep's folder and its MLflow experiment; then every
    partition, built before anything runs."""
    for child in plan.children:
        child.run_dir = sweep_dir / f"{_slug(child.label)}-seed{child.seed}"
        child.cfg = child.cfg.model_copy(update={"tracking": child.cfg.tracking.model_copy(update={
            "experiment": experiment, "register_model": register_models and child.cfg.tracking.register_model})})
    for child in plan.children:  # data errors are one line, before anything runs
        build_partition(child.cfg, partitions_root)


def _open_parent(plan: Plan, sweep_dir: Path, state: dict, uri: str, experiment: str, run_name: str) -> Optional[Tracker]:
    """The MLflow parent run (the one sweep.json names when the sweep continues); None without tracking."""
    base = plan.base
    if not base.tracking.enabled:
        return None
    return Tracker(uri, experiment, run_name, run_id=state.get("parent_run_id"),
                   params={"sweep.experiment": base.name, "sweep.grid": json.dumps(plan.grid),
                           "sweep.seeds": " ".join(map(str, plan.seeds)), "sweep.runs": len(plan.children),
                           "sweep.dir": str(sweep_dir.resolve())} if not state else None,
                   tags={"flockfl.sweep.dir": str(sweep_dir.resolve()), "flockfl.sweep.digest": plan.digest})


def _close_parent(parent: Tracker, result: SweepResult) -> None:
    """The sweep's summary, table and per-combination means on the parent run, then its status."""
    plan = result.plan
    table = sweep_table(plan)
    parent.log_dict(sweep_summary(result), "sweep/summary.json")
    parent.log_text(table, "sweep/summary.md")
    agg = aggregate(plan)
    parent.log_values({f"{_metric_key(label)}/{k}_mean": v["mean"] for label, row in agg.items()
                       for k, v in row["metrics"].items() if v["mean"] == v["mean"]}, step=0)
    parent.finish("FAILED" if result.failed else "FINISHED")


class _Sweep:
    """A sweep while its runs go on: sweep.json's contents (``state``, its ``runs`` recorded as
    each changes), the MLflow parent run, and how one child is run, settled, or failed."""

    def __init__(self, plan: Plan, sweep_dir: Path, state: dict, uri: str, parent: Optional[Tracker],
                 partitions_root: str, progress: bool, log, on_finished):
        self.plan, self.sweep_dir, self.state, self.uri, self.parent = plan, sweep_dir, state, uri, parent
        self.partitions_root, self.progress, self.log, self.on_finished = partitions_root, progress, log, on_finished
        self.runs = state.setdefault("runs", {})
        self.lock = threading.Lock()
        self.tags = {"flockfl.sweep.dir": str(sweep_dir.resolve())}

    def record(self, child: Child) -> None:
        with self.lock:
            self.runs[child.key] = {"label": child.label, "seed": child.seed, "run_dir": str(child.run_dir),
                                    "status": child.status, "error": child.error,
                                    "summary": _slim(child.summary) if child.summary else None}
            _write(self.sweep_dir, self.state)

    def run_name(self, child: Child) -> str:
        return f"{self.plan.base.name} {child.key}"

    def run_tags(self, child: Child) -> dict:
        """A child's MLflow tags: the sweep's folder, its grid combination and its seed."""
        return {**self.tags, "flockfl.sweep.combo": child.label, "flockfl.seed": str(child.seed)}

    def todo(self) -> list[Child]:
        """The children to run (an interrupted one resumes from its checkpoints); a finished one is
        kept as it was. Every child is recorded."""
        todo = []
        for child in self.plan.children:
            info = read_run_file(child.run_dir)
            prior = self.runs.get(child.key) or {}
            if info.get("finished") and prior.get("status") == "finished" and prior.get("summary"):
                child.status, child.summary = "finished", prior["summary"]  # kept as it was
            else:
                child.resumed = bool(list_checkpoints(child.run_dir))
                todo.append(child)
            self.record(child)
        return todo

    def fail(self, child: Child, err: Union[Exception, str]) -> None:
        """Record ``child`` as failed (``err``: the error, or its text from a worker process); the sweep goes on."""
        if os.environ.get("FLOCKFL_DEBUG"):
            raise err if isinstance(err, Exception) else RuntimeError(err)
        child.status, child.summary = "failed", None
        child.error = err if isinstance(err, str) else error_text(err)
        self.log(f"sweep: {child.key} failed: {child.error} (its run directory {child.run_dir} keeps error.log)")
        self.record(child)

    def run_child(self, child: Child) -> Optional[Child]:
        """Run ``child`` up to its end; its tracking (the model export) goes on in the background
        until :meth:`settle_child`. Returns the child, or None if it failed."""
        child.summary, err = run_one(child, self.run_name(child), self.run_tags(child), self.partitions_root, self.uri,
                                     self.parent.run_id if self.parent else None, self.progress)
        if err is None:
            return child
        if interrupted(err):  # Ctrl-C: the sweep stops here, the run resumes next time (flows/interrupt.py)
            raise KeyboardInterrupt(f"sweep interrupted during {child.key}") from err
        self.fail(child, err)
        return None

    def settle_child(self, child: Optional[Child]) -> None:
        """Wait for ``child``'s tracking to close, then record it as finished (or failed)."""
        if child is None:
            return
        try:
            settle(child.summary)
        except Exception as err:
            self.fail(child, err)
            return
        child.status, child.error = "finished", None
        m = child.summary["metrics"]
        self.log(f"sweep: {child.key}: accuracy {m.get('accuracy', float('nan')):.4f}"
                 + (f" (resumed from round {child.summary['resumed_from_round']})" if child.summary.get("resumed_from_round") else "")
                 + f", {child.summary['sweep_wall_s']:.1f} s")
        self.record(child)
        if self.on_finished:
            self.on_finished(child)

    def run(self, todo: list[Child], parallel: int, stack: int = 0) -> None:
        """Run ``todo``: ``parallel`` > 1 in that many processes (:meth:`in_processes`), else in
        stacks of up to ``stack`` cells trained together (:meth:`stacked`), else one after
        another (:meth:`one_after_another`). A Ctrl-C is noted: it stops the sweep rather than
        failing the run it cut; whatever stops the sweep marks the parent run KILLED."""
        cap = None
        if parallel > 1 and not os.environ.get("FLOCKFL_MAX_THREADS"):
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            cap = os.environ["FLOCKFL_MAX_THREADS"] = str(max(1, cores // parallel))  # N processes share the cores
        guard = watch()  # a Ctrl-C is noted: it stops the sweep rather than failing the run it cut
        guard.__enter__()
        try:
            if parallel > 1 and len(todo) > 1:
                self.in_processes(todo, parallel, stack)
            elif stack > 1 and len(todo) > 1:
                self.stacked(todo, stack)
            else:
                self.one_after_another(todo)
        except BaseException:
            if self.parent:
                self.parent.finish("KILLED")
            raise
        finally:
            guard.__exit__(None, None, None)
            if cap:
                os.environ.pop("FLOCKFL_MAX_THREADS", None)

    def in_processes(self, todo: list[Child], parallel: int, stack: int) -> None:
        """The jobs (:func:`flows.sweep_jobs.make_jobs`) shared by this process and ``parallel`` − 1
        worker processes (flows/sweep_workers.py), started first: their imports overlap this
        process's first job. This process records every child as it is reported."""
        jobs = make_jobs(todo, parallel, stack, self.run_name, self.run_tags)
        workers = Workers(min(parallel, len(jobs)) - 1, jobs, self.uri, self.partitions_root,
                          self.parent.run_id if self.parent else None, self.reported)
        settling: list[threading.Thread] = []
        try:
            while not sigint_seen():
                job = workers.next_local()
                if job is None:
                    break
                if job.stack:
                    self.stack_job(job.children)
                    continue
                done = self.run_child(job.children[0])
                settling.append(threading.Thread(target=self.settle_child, args=(done,), name="flockfl-sweep-settle"))
                settling[-1].start()
            for t in settling:
                t.join()
            workers.join()
        except BaseException:
            workers.stop()
            raise
        if workers.interrupted or sigint_seen():
            raise KeyboardInterrupt("sweep interrupted (its worker processes stopped their runs)")

    def reported(self, child: Child, summary: Optional[dict], error: Union[Exception, str, None], stopped: bool) -> None:
        """How a child of a job ended (in a worker process, ``error`` its text; or a cell of this
        process's stack): finished (settled and recorded), failed, or stopped by a Ctrl-C (left to resume)."""
        if stopped:
            return
        if error is not None:
            self.fail(child, error)
            return
        child.summary = summary
        self.settle_child(child)

    def stacked(self, todo: list[Child], size: int) -> None:
        """The children that can be cells (flows/stack.py), ``size`` at a time, each stack one flow
        whose cells train together (:meth:`stack_job`); then the others one after another."""
        from flows.stack import stackable

        cells = [c for c in todo if stackable(c.cfg)]
        for a in range(0, len(cells), size):
            if sigint_seen():
                raise KeyboardInterrupt(f"sweep interrupted before {cells[a].key}")
            self.stack_job(cells[a:a + size])
        self.one_after_another([c for c in todo if not stackable(c.cfg)])

    def stack_job(self, chunk: list[Child]) -> None:
        """One stack (:func:`run_stacked`), then each of its children settled and recorded."""
        try:
            results = run_stacked(chunk, [self.run_name(c) for c in chunk], [self.run_tags(c) for c in chunk],
                                  self.partitions_root, self.uri, self.parent.run_id if self.parent else None)
        except Exception as err:
            if interrupted(err):
                raise KeyboardInterrupt(f"sweep interrupted during the stack of {chunk[0].key}") from err
            for c in chunk:
                self.fail(c, err)
            return
        stopped = None
        for child, (summary, err) in zip(chunk, results):
            cut = err is not None and interrupted(err)
            stopped = err if cut else stopped
            error = err if err is None or isinstance(err, Exception) else RuntimeError(str(err))
            self.reported(child, summary, error, cut)
        if stopped is not None:
            raise KeyboardInterrupt("sweep interrupted during a stack") from stopped

    def one_after_another(self, todo: list[Child]) -> None:
        """Each run's models export while the next run starts (at most one run closing at a
        time); a thread records it the moment its export is done, so a kill of the sweep later
        on finds it finished."""
        closing: Optional[tuple[threading.Thread, Optional[Child]]] = None
        for child in todo + [None]:
            if child and sigint_seen():  # a Ctrl-C that the last run absorbed: start nothing new
                raise KeyboardInterrupt(f"sweep interrupted before {child.key}")
            done = self.run_child(child) if child else None
            if closing:
                t = time.perf_counter()
                closing[0].join()
                if closing[1] and closing[1].status == "finished":  # what the sweep itself waited for it
                    closing[1].summary["sweep_wall_s"] += time.perf_counter() - t
                    self.record(closing[1])
            if done:
                closing = (threading.Thread(target=self.settle_child, args=(done,), name="flockfl-sweep-settle"), done)
                closing[0].start()
            else:
                closing = None


def _slug(text: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "._-=" else "_" for ch in text.replace(" ", ","))
    return keep.replace("=", "") or "base"


def _metric_key(label: str) -> str:
    """An MLflow metric name for a combination label (keys allow alphanumerics, _-. / and space)."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in label.replace("=", "_"))


def _slim(summary: dict) -> dict:
    """What sweep.json keeps of a run's summary (enough for the table and the report)."""
    keys = ("run_id", "run_dir", "rounds", "resumed_from_round", "metrics", "state_sha256", "wall_s", "rounds_wall_s",
            "round_s_median", "sweep_wall_s", "phases_s", "bytes_total", "clients_dropped", "rounds_to_target", "sim_time_to_target",
            "protocol", "stack", "worker")
    return {k: summary.get(k) for k in keys if k in summary}


def _read(sweep_dir: Path) -> dict:
    path = sweep_dir / SWEEP_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{path} is not valid JSON (a torn write?); remove it to restart the sweep's bookkeeping "
                        f"(finished runs keep their run directories)") from None


def _write(sweep_dir: Path, state: dict) -> None:
    tmp = sweep_dir / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, sweep_dir / SWEEP_FILE)
