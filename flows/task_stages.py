"""The round's stages as Prefect tasks (:func:`task_stages`): the same functions the plain loop
of ``flockfl.rounds`` calls, each wrapped in its task from ``tasks``, with local training as one
retried ``train_shard`` task per shard of the cohort, or on the Dask cluster with
``executor.kind=dask``."""

from __future__ import annotations

from typing import Optional

from prefect.utilities.annotations import quote as Q

import tasks
from flockfl import rounds, training
from flockfl.engine import TrainResult
from flows.dask import DaskTraining


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
    train = tasks.retried(tasks.train_shard, cfg.max_retries)

    def run(shards):
        if cfg.parallel_shards > 1:
            futures = [train.submit(Q(prep), Q(shard), engine, r) for shard in shards]
            states = [f.wait() or f.state for f in futures]
        else:
            # one shard at a time, in this thread: torch's intra-op pool is warm here, and a
            # worker thread measured ~40% slower per step on 2 cores
            states = [train(Q(prep), Q(shard), engine, r, return_state=True) for shard in shards]
        return [st.result().unquote() if st.is_completed() else None for st in states]

    return training.shard_loop(spec, cfg.shard_size, run, lambda shard: tasks.isolate_failures(Q(prep), Q(shard), engine, r))
