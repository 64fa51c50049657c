"""MLflow tracking for one experiment run (the only module that imports MLflow).

One MLflow run per experiment. Per-round metrics go in one ``log_batch`` call (SQLite costs
~6 ms per single ``log_metric``). The run id is kept in the run directory, so ``flock
resume`` keeps logging into the same MLflow run, and rounds already logged are not logged
twice.

The store is opened with :func:`open_store` (a new SQLite store is created by one process at
a time, so ``flock run``s started together on it all work), experiments with
:func:`ensure_experiment` (a training experiment, not a GenAI one), and links into the MLflow
UI are made by :func:`ui_url` (the training view).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

DEFAULT_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(cli_uri: Optional[str], cfg_uri: Optional[str]) -> str:
    """--tracking-uri, then tracking.uri, then MLFLOW_TRACKING_URI, then ./mlflow.db (made absolute)."""
    uri = cli_uri or cfg_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


# MLflow 3's UI shows an experiment by its kind: as a GenAI experiment (traces, judges) or a
# training one (runs and their charts). Earlier 3.x UIs read it from this tag;
KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# later ones (3.17 at least) ignore the tag: a global GenAI / Model training switch (default
# GenAI, kept in the browser, or this query parameter of the page's URL) decides
UI_WORKFLOW = "workflowType=machine_learning"

_READY: set[str] = set()  # store URIs this process has opened (schema known to exist)
_READY_LOCK = threading.Lock()


def _sqlite_file(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:`` URI; None for other stores and in-memory SQLite."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``, whose store exists when this returns.

    MLflow creates a missing SQLite store's schema when a client first touches it; two processes
    doing that at once both run the migration and one fails (``table ... already exists``). So
    the first touch of a SQLite store in each process holds an exclusive lock on
    ``<db>.lock`` beside the database: one process creates the schema (and the Default
    experiment), the others wait and then open a complete store. Other URIs are opened as is."""
    from mlflow.tracking import MlflowClient

    db = _sqlite_file(uri)
    with _READY_LOCK:
        if db is not None and not (uri in _READY and db.exists()):
            db.parent.mkdir(parents=True, exist_ok=True)
            with open(db.with_name(db.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                client.search_experiments(max_results=1)  # creates the tracking store (and schema)
                client.search_registered_models(max_results=1)  # and the registry store on it
        _READY.add(uri)
    return MlflowClient(tracking_uri=uri)


def _mark_training(client, exp) -> None:
    """Tag ``exp`` as a training experiment (a deleted one, which MLflow will not tag, is left)."""
    from mlflow.exceptions import MlflowException

    if exp.lifecycle_stage != "active" or exp.tags.get(KIND_TAG) == TRAINING_KIND:
        return
    try:
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, TRAINING_KIND)
    except MlflowException:  # another process tagged it at the same moment
        if client.get_experiment(exp.experiment_id).tags.get(KIND_TAG) != TRAINING_KIND:
            raise


def ensure_experiment(name: str, uri: Optional[str] = None) -> str:
    """The id of experiment ``name`` in the store ``uri`` (default: MLflow's current tracking
    URI), created if missing; either way tagged as a training experiment
    (``mlflow.experimentKind = custom_model_development``), so the MLflow UI shows its runs and
    charts. Safe when several processes create the same experiment at once."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = open_store(uri or mlflow.get_tracking_uri())
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={KIND_TAG: TRAINING_KIND})
        except MlflowException as err:  # another process created it in between
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    _mark_training(client, exp)
    return exp.experiment_id


def ui_url(base: str, experiment_id: Optional[str] = None, run_id: Optional[str] = None,
           artifact: Optional[str] = None) -> str:
    """A link into the MLflow UI at ``base`` (e.g. ``http://127.0.0.1:5000``) that opens on the
    training view: the experiment list, an experiment's runs, a run, or one of its artifacts."""
    route = "experiments"
    if experiment_id is not None:
        route += f"/{experiment_id}"
        if run_id is not None:
            route += f"/runs/{run_id}"
            if artifact:
                route += f"/artifacts/{artifact.strip('/')}"
    return f"{base.rstrip('/')}/#/{route}?{UI_WORKFLOW}"


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


_EXPORT_LOCK = threading.Lock()


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


class Tracker:
    """Creates or re-opens the MLflow run of an experiment and logs to it."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: Optional[str] = None,
                 params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None):
        import mlflow

        self.uri = uri
        mlflow.set_tracking_uri(uri)
        self.client = open_store(uri)
        if run_id is None:
            exp_id = ensure_experiment(experiment, uri)
            run = self.client.create_run(exp_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id
            if params:
                self._log_params(params)
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
        if run_id is not None:  # a resumed run: its experiment may predate the kind tag
            _mark_training(self.client, self.client.get_experiment(self.experiment_id))

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for a in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[a : a + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def last_logged_round(self) -> int:
        hist = self.client.get_metric_history(self.run_id, "round")
        return int(max((m.step for m in hist), default=0))

    def log_round(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        step = int(row["round"])
        metrics = [Metric(k, v, ts, step) for k, v in _numeric(row).items()]
        for a in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[a : a + 1000])

    def log_values(self, values: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in values.items()])

    def log_pre_federation(self, cost: dict[str, Any]) -> None:
        """The one-shot pre-federation step's cost, at step 0."""
        self.log_values({f"pre_federation_{k}": v for k, v in cost.items()}, step=0)

    def log_dict(self, obj: dict, name: str) -> None:
        self.client.log_dict(self.run_id, obj, name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_artifact(self, path: Path, subdir: Optional[str] = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_models(self, model, stacked: dict, registered_name: Optional[str], input_example,
                   fmt: str = "pt2") -> list[str]:
        """Log one model per cluster with mlflow.pytorch and register each as a version.

        ``fmt`` is ``tracking.model_format``: ``pt2`` (torch.export; loads back as a GraphModule
        anywhere, costs ~3 s of imports once per process and ~0.15 s per model) or ``pickle``
        (loads back as the flockfl model class where flockfl is installed, ~0.05 s per model)."""
        import copy

        import mlflow
        import mlflow.pytorch
        import torch

        versions = []
        k = next(iter(stacked.values())).shape[0]
        reqs = [f"torch=={torch.__version__.split('+')[0]}"]
        # the registry prints "Created version ..." to stderr for every version: keep it quiet
        # (and the pickle format's warning about unpickling untrusted files: these are the run's own)
        # torch.export traces through process-global state: one model at a time (flock sweep --parallel)
        with _EXPORT_LOCK, mlflow.start_run(run_id=self.run_id), contextlib.redirect_stderr(io.StringIO()), \
                _quiet("mlflow.pytorch"):
            for j in range(k):
                net = copy.deepcopy(model).cpu()
                net.load_state_dict({n: v[j].cpu() for n, v in stacked.items()}, strict=False)
                # the k models share one architecture: MLflow's check that a logged pt2 model loads
                # and serves its input example (~0.1 s, it loads the model back) runs on the first
                # only (pickle forwards unknown keywords to torch.save: its check always runs)
                extra = {"validate_serving_input": j == 0} if fmt == "pt2" else {}
                info = mlflow.pytorch.log_model(
                    net, name=f"cluster_{j}", input_example=input_example, pip_requirements=reqs,
                    registered_model_name=registered_name, serialization_format=fmt, **extra,
                )
                if registered_name and getattr(info, "registered_model_version", None):
                    self.client.set_model_version_tag(registered_name, str(info.registered_model_version), "cluster", str(j))
                    versions.append(str(info.registered_model_version))
        return versions

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
