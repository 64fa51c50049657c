"""A run's final models: logged to MLflow (one per cluster) and registered as versions.

:func:`export_models` is idempotent: a run killed while exporting exports, on resume, only the
models it does not hold yet (:func:`exported` reads what it holds). MLflow's chatter is kept out
of the console for the exporting thread only (tasks/quiet.py), so a sweep's next run prints on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

from flockfl.faults import maybe_crash
from tasks.quiet import quiet_stderr

_EXPORT_LOCK = threading.Lock()


@contextlib.contextmanager
def _own_requirements():
    """Skip MLflow's check that a logged model's pip requirements match this environment (when
    it saves the model, and when it loads it back to validate the input example): ours are
    this environment's own (``torch==<installed>``), and the check first maps every installed
    distribution to its modules (~0.6 s of a 2-core process). Modules that no longer have the
    hook are left alone."""
    import mlflow.pyfunc
    import mlflow.utils.environment

    name = "warn_dependency_requirement_mismatches"
    saved = {m: getattr(m, name) for m in (mlflow.utils.environment, mlflow.pyfunc) if hasattr(m, name)}
    for m in saved:
        setattr(m, name, lambda requirements: None)
    try:
        yield
    finally:
        for m, check in saved.items():
            setattr(m, name, check)


@contextlib.contextmanager
def _quiet(logger: str):
    """Silence one logger's warnings for a block."""
    import logging

    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def export_models(tracker, model, stacked: dict, registered_name: Optional[str], input_example,
                  fmt: str = "pt2") -> list[str]:
    """Log one model per cluster with mlflow.pytorch and register each as a version.

    ``fmt`` is ``tracking.model_format``: ``pt2`` (torch.export; loads back as a GraphModule
    anywhere, costs ~2 s of imports once per process and ~0.15 s per model) or ``pickle``
    (loads back as the flockfl model class where flockfl is installed, ~0.05 s per model).
    Idempotent: models this run already holds (an export a kill cut short) are kept, a model
    logged but not registered is registered, a partly written one is replaced."""
    import copy

    import mlflow
    import mlflow.pytorch
    import torch

    logged, versions = exported(tracker, registered_name)
    k = next(iter(stacked.values())).shape[0]
    reqs = [f"torch=={torch.__version__.split('+')[0]}"]
    # the registry prints "Created version ..." to stderr for every version: keep it quiet, in
    # this thread only (a sweep's next run and its log lines go on meanwhile: tasks/quiet.py)
    # (and the pickle format's warning about unpickling untrusted files: these are the run's own)
    # torch.export traces through process-global state: one model at a time (flockfl sweep --parallel)
    with _EXPORT_LOCK, mlflow.start_run(run_id=tracker.run_id), quiet_stderr(), \
            _quiet("mlflow.pytorch"), _own_requirements():
        for j in range(k):
            if j in versions or (j in logged and not registered_name):
                continue
            uri = logged.get(j)
            if uri is None:
                net = copy.deepcopy(model).cpu()
                net.load_state_dict({n: v[j].cpu() for n, v in stacked.items()}, strict=False)
                # the k models share one architecture: MLflow's check that a logged pt2 model loads
                # and serves its input example (~0.1 s, it loads the model back) runs on the first
                # only (pickle forwards unknown keywords to torch.save: its check always runs)
                extra = {"validate_serving_input": j == 0} if fmt == "pt2" else {}
                uri = mlflow.pytorch.log_model(
                    net, name=f"cluster_{j}", input_example=input_example, pip_requirements=reqs,
                    serialization_format=fmt, **extra,
                ).model_uri
            maybe_crash("export", j)  # the drill: killed between logging model j and registering it
            if registered_name:
                versions[j] = str(mlflow.register_model(uri, registered_name, tags={"cluster": str(j)}).version)
    return [versions[j] for j in range(k)] if registered_name else []


def exported(tracker, registered_name: Optional[str]) -> tuple[dict[int, str], dict[int, str]]:
    """What ``tracker``'s run already holds: cluster → URI of its logged model (a model a kill left
    half written is deleted), and cluster → its registered version."""
    from mlflow.entities import LoggedModelStatus

    logged: dict[int, str] = {}
    token = None
    while True:
        page = tracker.client.search_logged_models([tracker.experiment_id],
                                                   filter_string=f"source_run_id = '{tracker.run_id}'", page_token=token)
        for m in page:
            if not m.name.startswith("cluster_"):
                continue
            if m.status == LoggedModelStatus.READY:
                logged[int(m.name.split("_", 1)[1])] = m.model_uri
            else:
                tracker.client.delete_logged_model(m.model_id)
        token = page.token
        if not token:
            break
    versions: dict[int, str] = {}
    if registered_name:
        for v in tracker.client.search_model_versions(f"run_id = '{tracker.run_id}'"):
            if v.name == registered_name and "cluster" in v.tags:
                versions[int(v.tags["cluster"])] = str(v.version)
    return logged, versions
