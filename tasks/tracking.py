"""MLflow tracking for one experiment run (the only module that imports MLflow).

One MLflow run per experiment. Per-round metrics go in one ``log_batch`` call (SQLite costs
~6 ms per single ``log_metric``). The run id is kept in the run directory, so ``flock
resume`` keeps logging into the same MLflow run, and rounds already logged are not logged
twice.
"""

from __future__ import annotations

import contextlib
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
        from mlflow.tracking import MlflowClient

        self.uri = uri
        mlflow.set_tracking_uri(uri)
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id
            if params:
                self._log_params(params)
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id

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
