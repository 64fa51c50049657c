"""The MLflow run of one experiment: created or re-opened, and logged to.

One MLflow run per experiment. Per-round metrics go in one ``log_batch`` call, rounds queued together in one (SQLite costs
~6 ms per single ``log_metric``). The run id is kept in the run directory, so ``flockfl
resume`` keeps logging into the same MLflow run, and rounds already logged are not logged
twice. Metrics and params get MLflow's names (flows/tracking/names.py), the run its source
tags (flows/tracking/source.py), and the final models are exported by
flows/tracking/export.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional

from flows.tracking.export import export_models
from flows.tracking.names import is_report_mode, metric_name
from flows.tracking.source import source_tags
from flows.tracking.store import ensure_experiment, mark_training, open_store


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class Tracker:
    """Creates or re-opens the MLflow run of an experiment and logs to it."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: Optional[str] = None,
                 params: Optional[dict[str, Any]] = None, tags: Optional[dict[str, str]] = None):
        import mlflow

        self.uri = uri
        mlflow.set_tracking_uri(uri)
        self.client = open_store(uri)
        self._params: Optional[set[str]] = None  # the run's param keys, once read (log_once)
        source = source_tags()
        if run_id is None:
            exp_id = ensure_experiment(experiment, uri)
            run = self.client.create_run(exp_id, run_name=run_name, tags={**source, **(tags or {})})
            self.run_id = run.info.run_id
            self._params = set()
            if params:
                self._log_params(params)
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        run = self.client.get_run(self.run_id)
        self.experiment_id = run.info.experiment_id
        if run_id is not None:  # a resumed run: its experiment may predate the kind tag
            mark_training(self.client, self.client.get_experiment(self.experiment_id))
            self._resumed_source(run.data.tags, source)
        # the last round this MLflow run holds (a resumed run logs only the rounds after it)
        self.logged = self.last_logged_round() if run_id is not None else 0

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for a in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[a : a + 100])
        if self._params is not None:
            self._params.update(params)

    def _resumed_source(self, tags: dict[str, str], source: dict[str, str]) -> None:
        """A resumed run keeps the commit it started from; when this process runs other code
        (another commit, or a dirty tree), that is tagged beside it (``flockfl.resumed_git_commit``,
        ``flockfl.resumed_git_dirty``). A run from before these tags gets them now."""
        if not source:
            return
        if "mlflow.source.git.commit" not in tags:
            self.set_tags(source)
        elif (tags.get("mlflow.source.git.commit"), tags.get("flockfl.git_dirty")) != (
                source["mlflow.source.git.commit"], source["flockfl.git_dirty"]):
            self.set_tags({"flockfl.resumed_git_commit": source["mlflow.source.git.commit"],
                           "flockfl.resumed_git_dirty": source["flockfl.git_dirty"]})

    def log_once(self, values: dict[str, Any]) -> None:
        """Numbers a run has once (the partition's measures, the pre-federation cost, the last
        round's report modes) as params. MLflow's params cannot change: a key the run already
        holds (a resumed run logging it again) keeps its first value."""
        if self._params is None:
            self._params = set(self.client.get_run(self.run_id).data.params)
        new = {k: v for k, v in values.items() if k not in self._params}
        if new:
            self._log_params(new)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def last_logged_round(self) -> int:
        hist = self.client.get_metric_history(self.run_id, "round")
        return int(max((m.step for m in hist), default=0))

    def _round_metrics(self, row: dict[str, Any], ts: int) -> list:
        """One history row's metrics (its report modes go to params, once)."""
        from mlflow.entities import Metric

        step = int(row["round"])
        values = _numeric(row)
        once = {k: v for k, v in values.items() if is_report_mode(k)}  # the last round's report modes
        if once:
            self.log_once(once)
        return [Metric(metric_name(k), v, ts, step) for k, v in values.items() if k not in once]

    def log_rounds(self, rows: list[dict[str, Any]]) -> None:
        """Log the history rows this run does not hold yet: after a resume, or a fallback to an
        older checkpoint, a recomputed round was logged already and is not logged twice. Rows go
        in as few ``log_batch`` calls as fit MLflow's 1,000 metrics a call (each one a store
        transaction: ~20 ms on SQLite, most of a round's tracking), a row never split between two
        unless it alone has more, so a kill leaves whole rounds logged and ``logged`` true."""
        ts = int(time.time() * 1000)
        batch: list = []
        last = self.logged
        for row in rows:
            if row["round"] <= last:
                continue
            metrics = self._round_metrics(row, ts)
            if batch and len(batch) + len(metrics) > 1000:
                self._log_metrics(batch, last)
                batch = []
            batch += metrics
            last = int(row["round"])
        if batch or last > self.logged:
            self._log_metrics(batch, last)

    def _log_metrics(self, metrics: list, upto: int) -> None:
        for a in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[a : a + 1000])
        self.logged = upto

    def catch_up(self, measures: dict[str, float], history: list[dict[str, Any]]) -> None:
        """A run's first entries: the partition's measures (params) on a run that logged no
        round yet, and the rounds a killed run checkpointed but never logged."""
        if self.logged == 0 and measures:
            self.log_once(measures)
        self.log_rounds(history)

    def log_values(self, values: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in values.items()])

    def log_pre_federation(self, cost: dict[str, Any]) -> None:
        """The one-shot pre-federation step's cost, as params ``pre_federation_*``."""
        self.log_once({f"pre_federation_{k}": v for k, v in cost.items()})

    def log_dict(self, obj: dict, name: str) -> None:
        self.client.log_dict(self.run_id, obj, name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_artifact(self, path: Path, subdir: Optional[str] = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_models(self, model, stacked: dict, registered_name: Optional[str], input_example,
                   fmt: str = "pt2") -> list[str]:
        """Log one model per cluster and register each as a version (:func:`export_models`)."""
        return export_models(self, model, stacked, registered_name, input_example, fmt)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
