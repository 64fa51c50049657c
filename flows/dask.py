"""``executor.kind=dask``: training shards on a Dask cluster through prefect-dask's
DaskTaskRunner (a LocalCluster on 127.0.0.1, or an existing scheduler at ``executor.address``).
Workers load the partition once by content hash (``flockfl.executor``); a task carries only its
shard's rows. Every other stage of the round runs in the flow's process, where the data is."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

from prefect.utilities.annotations import quote as Q

import tasks
from flockfl import executor, rounds, training
from flockfl.engine import TrainResult
from flockfl.stages import shift
from flockfl.state import ServerState


class DaskTraining:
    """The train stage on a Dask cluster (``executor.kind=dask``).

    Each shard becomes one ``train_shard_remote`` task carrying a pickled
    :class:`flockfl.executor.ShardJob`: the shard's rows, never the dataset (workers load the
    partition by content hash from ``executor.data_root``). Results come back pickled and are
    concatenated in shard order, so which worker ran a shard does not matter. A shard that still
    fails after its retries has its clients trained one by one here, as in a local run; a shard
    whose workers kept dying (Dask's ``KilledWorker``) likewise. Counts the bytes moved."""

    def __init__(self, prep: rounds.PreparedRun, partitions_root: str, gpu: bool):
        ex = prep.cfg.executor
        self.base = dict(config=prep.cfg.model_dump(), context_key=executor.context_key(prep.cfg),
                         data_root=str(Path(ex.data_root or partitions_root).resolve()),
                         partition_hash=prep.partition_hash, threads=ex.threads_per_worker,
                         gpu_memory_fraction=ex.gpu_memory_fraction)
        self.gpu = gpu
        self.device = prep.ctx.data.train.x.device
        self.shift: Optional[dict] = None
        self.counts = self._zero()

    @staticmethod
    def _zero() -> dict:
        return {"executor_bytes_to_workers": 0, "executor_bytes_from_workers": 0, "executor_shards": 0,
                "executor_shards_local": 0, "executor_pieces": 0, "executor_worker_s": 0.0}

    def take_counts(self) -> dict:
        out, self.counts = self.counts, self._zero()
        return out

    def select(self, prep: rounds.PreparedRun, state: ServerState, r: int):
        state, spec = tasks.select(Q(prep), Q(state), r)
        self.shift = state.algo.get(shift.KEY)  # the workers train on this round's data view
        return state, spec

    def train(self, prep: rounds.PreparedRun, spec, engine: str, r: int) -> tuple[Optional[TrainResult], list[int]]:
        import dask

        cfg = prep.cfg.train

        def run(shards):
            jobs = [executor.pack(executor.ShardJob(**self.base, shift=self.shift, spec=s, engine=engine, round=r))
                    for s in shards]
            task = tasks.retried(tasks.train_shard_remote, cfg.max_retries)
            with dask.annotate(resources={"GPU": 1}) if self.gpu else nullcontext():
                futures = [task.submit(job) for job in jobs]
            for job, fut in zip(jobs, futures):
                payload = self._settle(fut)
                self.counts["executor_bytes_to_workers"] += len(job)
                self.counts["executor_shards"] += 1
                if payload is None:
                    self.counts["executor_shards_local"] += 1
                    yield None
                    continue
                result, info = executor.unpack_result(payload, self.device)
                self.counts["executor_bytes_from_workers"] += len(payload)
                self.counts["executor_pieces"] += info["pieces"]
                self.counts["executor_worker_s"] += info["seconds"]  # the shard's time on its worker
                yield result

        return training.shard_loop(spec, cfg.shard_size, run, lambda shard: tasks.isolate_failures(Q(prep), Q(shard), engine, r))

    @staticmethod
    def _settle(fut) -> Optional[bytes]:
        """The shard's pickled result, or None when it failed (its clients are then isolated)."""
        import distributed

        try:
            state = fut.wrapped_future.result()
        except distributed.KilledWorker:  # the shard killed allowed-failures workers in a row
            return None
        except Exception as err:  # the task never ran: the workers cannot load flockfl's code
            msg = str(err).splitlines()[0] if str(err) else ""
            raise executor.ExecutorError(f"executor: a training shard could not run on the Dask cluster "
                                         f"({type(err).__name__}: {msg}); the workers need flockfl installed") from None
        if state.is_completed():
            return state.result()
        err = state.result(raise_on_failure=False)
        if isinstance(err, executor.ExecutorError):  # the worker cannot read the run's data
            raise err
        return None


def dask_stage(prep: rounds.PreparedRun, partitions_root: str) -> DaskTraining:
    """The train stage for ``executor.kind=dask``, on the flow's DaskTaskRunner (connects now:
    an unreachable scheduler is a one-line error before any round runs)."""
    import warnings

    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    ex = prep.cfg.executor
    # a shard's rows can be megabytes (SCAFFOLD's per-client corrections); they are the payload
    warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
    runner = FlowRunContext.get().task_runner
    if not isinstance(runner, DaskTaskRunner):
        raise executor.ExecutorError("executor.kind: 'dask' needs the flow to run on a DaskTaskRunner; "
                                     "start it with flows.experiment.run_experiment (flockfl run)")
    try:
        workers = runner.client.scheduler_info(n_workers=-1)["workers"]
    except Exception as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise executor.ExecutorError(f"executor.address: cannot reach a Dask scheduler at {runner.address or ex.address!r} "
                                     f"({msg}); start one (dask scheduler) or fix executor.address") from None
    gpu = prep.cfg.train.device in ("cuda", "auto") and any(
        (w.get("resources") or {}).get("GPU", 0) > 0 for w in workers.values())
    return DaskTraining(prep, partitions_root, gpu)


@contextmanager
def dask_cluster(ex):
    """The scheduler address for ``executor``: the configured one, or a LocalCluster started
    here (``executor.workers`` processes, ``executor.threads_per_worker`` threads each, bound to
    127.0.0.1, no dashboard) that is closed when the block ends, also on failure."""
    import logging
    import os

    # quiet unless flockfl runs with --verbose: distributed logs every connection at INFO (the
    # environment reaches the worker processes; an exported value wins)
    quiet = os.environ.get("PREFECT_LOGGING_LEVEL", "").upper() not in ("DEBUG", "INFO")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error" if quiet else "info")
    logging.getLogger("distributed").setLevel(os.environ["DASK_LOGGING__DISTRIBUTED"].upper())
    if ex.address:
        yield ex.address
        return
    from distributed import LocalCluster

    # no dashboard; the scheduler's HTTP endpoint (health, metrics) on a free loopback port
    with own_thread_env():
        cluster = LocalCluster(n_workers=ex.workers, threads_per_worker=ex.threads_per_worker, processes=True,
                               host="127.0.0.1", dashboard_address=None,
                               scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, silence_logs=logging.ERROR)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@contextmanager
def own_thread_env():
    """Starting a LocalCluster sets OMP_NUM_THREADS=1 (and MKL's, OpenBLAS's) in *this* process's
    environment, meant for its workers; flockfl reads OMP_NUM_THREADS for a run's thread count, so
    every later run of the process (a sweep, the test suite) would train on one thread and end in
    other bits. The driver's own values are put back once the cluster has started."""
    saved = {k: os.environ.get(k) for k in THREAD_ENV}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def shared_prefect_api(address: str):
    """Workers on this machine report their task runs to this process's Prefect API.

    Without ``PREFECT_API_URL`` Prefect runs an ephemeral API server per process, and the
    settings the flow sends with each task would make every worker process start one of its
    own (and leave it behind when the worker is killed). For a scheduler on a loopback address
    the workers can reach the flow's per-process API (:mod:`flows.apiserver`, started here if
    ``flockfl`` did not start it already), so its URL is made explicit for the flow, and travels
    with the tasks. A configured ``PREFECT_API_URL`` is left alone."""
    import ipaddress

    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        from distributed.comm import get_address_host

        host = get_address_host(address)
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if PREFECT_API_URL.value() or not local:
        yield
        return
    from flows import apiserver

    server = apiserver.start()  # the process's API server, tied to this process
    if server is None:  # a profile names an API: Prefect uses it
        yield
        return
    server.wait()
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield
