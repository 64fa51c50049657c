"""The experiment flow: partition, restore, then rounds of select → train → cluster →
aggregate → evaluate → checkpoint/log.

Local training is mapped over shards of the cohort (each a vectorised batch of clients),
never one task per client. A failed shard is retried; if it still fails its clients are
trained one by one and the failing ones are dropped and recorded, and the round goes on.

Here: the flow body, what it does between the stages (:class:`RoundHooks`) and the entry
points that run it (:func:`run_experiment`, :func:`execute`). Its parts: the stages as tasks
(flows/task_stages.py), the MLflow run from opening to closing (flows/run_tracking.py), the
summary it returns (flows/run_summary.py), its clock (flows/run_clock.py), its core lease
(flows/leases.py), its progress bar (flows/progress.py) and patches of Prefect
(flows/prefect_patches.py).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path
from typing import Optional, Union

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote as Q

import tasks
from flockfl import rounds
from flockfl.algorithms import auto
from flockfl.config import ExperimentConfig
from flockfl.experiments import validate
from flockfl.state import CheckpointWriter, ServerState
from flows.dask import DaskTraining, dask_cluster, dask_stage, shared_prefect_api
from flows.leases import release_cores, request_cores, wait_for_cores
from flows.prefect_patches import heartbeats_without_join, result_keys_without_path_walks
from flows.progress import Progress
from flows.run_clock import RoundClock, timed
from flows.run_summary import RunRecord
from flows.run_tracking import CLOSING, finalise, open_tracking, settle
from flows.rundir import read_run_file, run_key, write_run_file
from flows.task_stages import task_stages
from flows.tracking.background import BackgroundTracker
from flows.tracking.store import prefetch

heartbeats_without_join()
result_keys_without_path_walks()


class Steps:
    """How the run's body calls its steps (``tasks``): as Prefect tasks (the flow), or as the
    tasks' own functions (``plain``: a cell of a stack, flows/stack.py, whose flow is the stack's)."""

    def __init__(self, plain: bool = False):
        self.plain = plain

    def __call__(self, task, *args):
        if not self.plain:
            return task(*args)
        return task.fn(*[a.unquote() if isinstance(a, Q) else a for a in args])


class RoundHooks:
    """What the flow does where ``rounds.drive`` calls back (after the pre-federation step, a
    cycle, a round): checkpoint the state, log to MLflow, move the progress bar and the rounds'
    clock."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str, tracker: Optional[BackgroundTracker],
                 remote: Optional[DaskTraining], bar: Progress, clock: RoundClock, steps: Steps = Steps()):
        self.cfg, self.run_dir, self.tracker, self.remote, self.bar, self.clock = cfg, run_dir, tracker, remote, bar, clock
        self.steps = steps
        self.writer = CheckpointWriter()  # each checkpoint written while the next round runs

    def save(self, st: ServerState) -> None:
        if self.tracker:  # the MLflow run a resume continues (waits for it to exist: by now it does)
            self.tracker.check()  # a failed log fails the run here, not at its end
            st.driver.mlflow_run_id = self.tracker.run_id
        self.steps(tasks.checkpoint, Q(self.writer), Q(st), self.run_dir, self.cfg.train.checkpoints_to_keep)

    def after_pre_federation(self, st: ServerState) -> None:
        self.save(st)  # resume never redoes it
        if self.tracker:
            self.tracker.log_pre_federation(st.driver.pre_federation)
            for rec in st.meta.get(auto.META_KEY, []):  # a threshold chosen before round 0 (algorithm.*=auto)
                self.tracker.log_values(auto.metrics(rec), step=0)
        self.clock.pre_federation_done()

    def after_cycle(self, st: ServerState) -> None:  # mid-round (FedCluster's cycles): resume starts at the next cycle
        self.save(st)

    def after_round(self, st: ServerState, row: dict) -> None:
        if self.remote:  # the round's traffic between this process and the workers (row is st.history[-1])
            row.update(self.remote.take_counts())
        self.save(st)
        if self.tracker:
            self.steps(tasks.log_metrics, Q(self.tracker), Q([row]))
        self.bar.update(row)
        self.clock.round_done()


@flow(name="flockfl-experiment", persist_result=False, log_prints=False)
def experiment_flow(config: dict, run_dir: str, partitions_root: str = "data/partitions",
                    tracking_uri: str = "sqlite:///mlflow.db", progress: Union[bool, str] = True,
                    parent_run_id: Optional[str] = None, run_tags: Optional[dict] = None,
                    run_name: Optional[str] = None) -> dict:
    """Run (or continue) one experiment; returns the summary that ``flockfl run --json`` prints.

    The rounds are :func:`flockfl.rounds.drive` with task-wrapped stages
    (:func:`flows.task_stages.task_stages`);
    each round is then checkpointed and logged.
    """
    return run_body(config, run_dir, partitions_root, tracking_uri, progress, parent_run_id, run_tags, run_name)


def run_body(config: dict, run_dir: str, partitions_root: str, tracking_uri: str, progress: Union[bool, str] = True,
             parent_run_id: Optional[str] = None, run_tags: Optional[dict] = None, run_name: Optional[str] = None,
             steps: Steps = Steps()) -> dict:
    """The experiment flow's body; with ``Steps(plain=True)`` the same run without tasks of its
    own (a cell of a stack: the stages are the plain loop's, the stack's flow trains them)."""
    t_start = time.perf_counter()
    cfg = validate(config)
    run_path = Path(run_dir)
    phases: dict[str, float] = {}
    with timed(phases, "partition"):
        prep = steps(tasks.partition, cfg, partitions_root)
    remote = dask_stage(prep, partitions_root) if cfg.executor.kind == "dask" else None
    with timed(phases, "restore"):
        state, warnings = steps(tasks.restore, Q(prep), run_dir)
    resumed_from = state.round
    with timed(phases, "tracker"):  # the MLflow run is created in the background (MLflow and the
        # store were loaded in the background since execute/run_experiment: prefetch)
        tracker = open_tracking(cfg, run_path, tracking_uri, parent_run_id, run_tags, run_name)
    if tracker:  # the partition's measures on a new run; the rounds a killed run never logged
        tracker.catch_up({f"partition_{k}": v for k, v in (prep.info.get("heterogeneity") or {}).items()
                          if isinstance(v, (int, float))}, [dict(h) for h in state.history])
    bar = Progress(cfg.train.rounds, state.round, cfg.name, bool(progress), json_out=progress == "stderr")
    clock = RoundClock(phases)
    hooks = RoundHooks(cfg, run_dir, tracker, remote, bar, clock, steps)
    leased = wait_for_cores(run_path, phases)  # the rounds start once this run's cores are free
    try:
        with timed(phases, "drive"):
            clock.start()
            stages = rounds.PLAIN if steps.plain else task_stages(remote)
            state = rounds.drive(prep, state, stages, on_pre_federation=hooks.after_pre_federation,
                                 on_round=hooks.after_round, on_cycle=hooks.after_cycle)
            hooks.writer.wait()  # the last checkpoint is on disk
        bar.close()
        # a resume of a run that had already finished must not register its models again
        with timed(phases, "finalise"):
            if resumed_from >= cfg.train.rounds and read_run_file(run_path).get("finished"):
                closing = tracker.finish("FINISHED") if tracker else None
            else:
                closing = finalise(prep, state, run_path, tracker, phases)
    except BaseException:
        bar.close()
        with contextlib.suppress(Exception):  # a write in flight lands (or fails) first: the error is the run's
            hooks.writer.wait()
        (run_path / "error.log").write_text(traceback.format_exc())
        if tracker:
            tracker.finish("FAILED")
            tracker.close(raise_errors=False)
        raise
    finally:
        release_cores(run_path)
    if tracker:
        CLOSING[run_key(run_path)] = (tracker, closing)
    out = RunRecord.of(cfg, prep, state, run_id=tracker.run_id if tracker else None, run_dir=run_path,
                       resumed_from=resumed_from, clock=clock, leased=leased, warnings=warnings, remote=bool(remote),
                       t_start=t_start).to_json()
    out["body_at"] = (t_start, time.perf_counter())  # for run_experiment's flow_start / flow_end phases
    return out


def run_experiment(cfg: ExperimentConfig, run_dir: Path, partitions_root: str, tracking_uri: str,
                   progress: Union[bool, str] = True, parent_run_id: Optional[str] = None, run_tags: Optional[dict] = None,
                   run_name: Optional[str] = None, wait: bool = True) -> dict:
    """Run the flow with a thread pool sized for the shards (one at a time on small machines),
    or with ``executor.kind=dask`` on a DaskTaskRunner (the scheduler at ``executor.address``, or
    a LocalCluster started and closed here).

    ``wait=False`` returns as soon as the rounds and plots are done, while the run's tracking
    closes in the background (the models export); :func:`flows.run_tracking.settle` then waits
    for it and adds ``model_versions`` to the summary. A sweep settles each run while the next
    one goes on."""
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
        pending = CLOSING.pop(run_key(run_dir), None)  # the flow failed after its rounds: nothing waits for it
        if pending:
            pending[0].close(raise_errors=False)
        raise
    # Prefect's own time around the flow body: waiting for the API, creating the flow run, ending it
    started, ended = summary.pop("body_at")
    summary["phases_s"].update(api_wait=t_call - t_api, flow_start=started - t_call, flow_end=time.perf_counter() - ended)
    return settle(summary) if wait else summary


def open_run_dir(cfg: ExperimentConfig, run_dir: Path, uri: str, partitions_root: str, fresh: bool,
                 metrics_file: Optional[str] = None) -> dict:
    """run.json of the run in ``run_dir`` (a fresh run first builds its partition, before any flow:
    data errors are one line, and writes it)."""
    import datetime as dt

    from flockfl.data.store import build_partition

    info = read_run_file(run_dir)
    if fresh or "config" not in info:
        build_partition(cfg, partitions_root)
        run_dir.mkdir(parents=True, exist_ok=True)
        info.update({"config": cfg.model_dump(), "tracking_uri": uri, "partitions_root": str(Path(partitions_root).resolve()),
                     "metrics_file": metrics_file, "created": dt.datetime.now().isoformat()})
        write_run_file(run_dir, info)
    return info


def execute(cfg: ExperimentConfig, run_dir: Path, *, tracking_uri: Optional[str], partitions_root: str, fresh: bool,
            progress: Union[bool, str] = True, metrics_file: Optional[str] = None, parent_run_id: Optional[str] = None,
            run_tags: Optional[dict] = None, run_name: Optional[str] = None, wait: bool = True) -> dict:
    """Run or resume ``cfg`` in ``run_dir``: what ``flockfl run``, ``flockfl resume``, a sweep's
    child and a scheduled run all do. A fresh run first builds its partition (before the flow:
    data errors are one line) and writes run.json; the metrics also go to ``metrics_file``
    (for DVC) when given here or in run.json. ``wait``: see :func:`run_experiment`."""
    import json

    from flows.tracking.store import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri, cfg.tracking.uri)
    if cfg.tracking.enabled:
        prefetch(uri)  # MLflow imports and opens its store while the partition builds
    info = open_run_dir(cfg, run_dir, uri, partitions_root, fresh, metrics_file)
    request_cores(cfg, run_dir)  # in line for the cores while Prefect, the data and the model set up
    try:
        summary = run_experiment(cfg, run_dir, info.get("partitions_root", partitions_root), uri, progress=progress,
                                 parent_run_id=parent_run_id, run_tags=run_tags, run_name=run_name, wait=wait)
    finally:
        release_cores(run_dir)
    if info.get("metrics_file") or metrics_file:
        path = Path(info.get("metrics_file") or metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rounds": summary["rounds"], **summary["metrics"],
                                    "round_s_median": summary["round_s_median"]}, indent=1, sort_keys=True))
    summary["tracking_uri"] = uri
    return summary
