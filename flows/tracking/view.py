"""Links into the MLflow UI and flockfl's saved view of an experiment's runs.

:func:`ui_url` makes a link that opens the UI on its training view (the experiment list, an
experiment's runs, a run or one of its artifacts). :func:`save_results_view` writes flockfl's
results view onto an experiment: a runs table whose columns are accuracy, ARI, the number of
clusters and the run's duration, which a link opens by its id.
"""

from __future__ import annotations

import time
from typing import Optional

# MLflow 3's UI shows an experiment by its kind, GenAI or training. Earlier 3.x UIs read it from
# an experiment tag (flows/tracking/store.py sets it); later ones (3.17 at least) ignore the tag:
# a global GenAI / Model training switch (default GenAI, kept in the browser, or this query
# parameter of the page's URL) decides
UI_WORKFLOW = "workflowType=machine_learning"


def ui_url(base: str, experiment_id: Optional[str] = None, run_id: Optional[str] = None,
           artifact: Optional[str] = None, view: Optional[str] = None) -> str:
    """A link into the MLflow UI at ``base`` (e.g. ``http://127.0.0.1:5000``) that opens on the
    training view: the experiment list, an experiment's runs, a run, or one of its artifacts.
    ``view`` (an experiment's runs only): a saved view of the runs table (:func:`save_results_view`)."""
    route = "experiments"
    query = UI_WORKFLOW
    if experiment_id is not None:
        route += f"/{experiment_id}"
        if run_id is not None:
            route += f"/runs/{run_id}"
            if artifact:
                route += f"/artifacts/{artifact.strip('/')}"
        elif view:
            route += "/runs"
            query = f"{VIEW_PARAM}={view}&{UI_WORKFLOW}"
    return f"{base.rstrip('/')}/#/{route}?{query}"


# The runs table of MLflow 3's experiment page picks its columns itself (run name, created,
# dataset, duration, source, models: no metric) and keeps a person's choice in the browser. A
# *saved view* is the one thing a link can bring: an experiment tag ``mlflow.sharedViewState.<id>``
# holding ``{"name", "createdAt", "updatedAt", "state"}`` (state: the table's JSON state), opened
# by ``#/experiments/<id>/runs?viewStateShareKey=<id>`` and listed in the page's saved-views menu
# (read from MLflow 3.17's UI bundle; older UIs read a bare state, which they also accept).
VIEW_TAG = "mlflow.sharedViewState."
VIEW_PARAM = "viewStateShareKey"
RESULTS_VIEW = "flockfl-results"
RESULTS_VIEW_NAME = "flockfl: results"
# (column id in the runs table, always shown?, width in px): the headline numbers, in this order,
# then the variants some algorithms have, and MLflow's run duration (run created to run ended:
# the rounds, the evaluation and the model export). The table always shows the run's name and
# when it was created first, and orders metric columns by name unless told (columnOrder).
RESULTS_COLUMNS = (("metrics.`accuracy`", True, 100), ("metrics.`ari`", True, 90), ("metrics.`num_clusters`", True, 115),
                   ("metrics.`accuracy_finetuned`", False, 145), ("metrics.`accuracy_personal`", False, 145),
                   ("attributes.`Duration`", True, None))
_FIXED_COLUMNS = (("attributes.`Run Name`", 140), ("runDateAndNestInfo", None), ("duration", None))


def results_view_state(metric_keys: Optional[set[str]] = None) -> dict:
    """The runs table's state of flockfl's results view: the headline columns (the optional ones
    only where ``metric_keys``, the experiment's metric names, has them) in order, newest run first."""
    cols = [(c, w) for c, always, w in RESULTS_COLUMNS
            if always or (metric_keys is not None and c[len("metrics.`"):-1] in metric_keys)]
    order = list(_FIXED_COLUMNS) + [(c, w) for c, w in cols if c.startswith("metrics.")]
    return {"selectedColumns": [c for c, _ in cols], "columnOrder": [c for c, _ in order],
            "columnWidths": {c: w for c, w in order if w}, "orderByKey": "attributes.start_time", "orderByAsc": False}


def save_results_view(client, experiment_id: str, metric_keys: Optional[set[str]] = None) -> str:
    """Write (or refresh) flockfl's results view on the experiment; returns its id for
    :func:`ui_url`'s ``view``. A view a person edited in the UI under the same id is replaced."""
    import json

    exp = client.get_experiment(experiment_id)
    key = VIEW_TAG + RESULTS_VIEW
    now = int(time.time() * 1000)
    state = json.dumps(results_view_state(metric_keys), separators=(",", ":"))
    try:
        old = json.loads(exp.tags.get(key) or "{}")
    except ValueError:
        old = {}
    if isinstance(old, dict) and old.get("state") == state:
        return RESULTS_VIEW
    created = old.get("createdAt") if isinstance(old, dict) and isinstance(old.get("createdAt"), int) else now
    client.set_experiment_tag(experiment_id, key, json.dumps(
        {"name": RESULTS_VIEW_NAME, "createdAt": created, "updatedAt": now, "state": state}, separators=(",", ":")))
    return RESULTS_VIEW
