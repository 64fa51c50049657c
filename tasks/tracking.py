"""MLflow tracking for one experiment run (the only module that imports MLflow).

One MLflow run per experiment. Per-round metrics go in one ``log_batch`` call (SQLite costs
~6 ms per single ``log_metric``). The run id is kept in the run directory, so ``flockfl
resume`` keeps logging into the same MLflow run, and rounds already logged are not logged
twice.

The store is opened with :func:`open_store` (a new SQLite store is created by one process at
a time, so ``flockfl run``s started together on it all work), experiments with
:func:`ensure_experiment` (a training experiment, not a GenAI one), and links into the MLflow
UI are made by :func:`ui_url` (the training view; an experiment's runs in flockfl's results
view, whose table shows accuracy, ARI, clusters and duration: :func:`save_results_view`).

MLflow's names sort for a person (:func:`metric_name`): the headline series under their own
names, each evaluation protocol's series under ``eval/``, per-cluster ones under ``cluster/``;
numbers a run has once are params; the git commit and a dirty flag are tags
(:func:`source_tags`). :func:`summary_metrics` reads a run back under flockfl's names, whether it
was logged before or after the renaming.

A run's tracking goes through a :class:`BackgroundTracker`: the same calls, made in order on one
background thread, so importing MLflow, opening the store and exporting the models overlap the
run instead of holding it up (:func:`prefetch` starts the import and the store before the run
is known). The model export is idempotent: a run killed while exporting exports, on resume,
only the models it does not hold yet.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

from flockfl.faults import maybe_crash
from tasks.quiet import quiet_stderr

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


def _store_lock(db: Path) -> Path:
    """The lock file of the SQLite store ``db``: one per database (its resolved path's digest) in
    ``$XDG_RUNTIME_DIR/flockfl-mlflow`` or ``<tmp>/flockfl-mlflow-<uid>``."""
    import hashlib
    import tempfile

    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "flockfl-mlflow" if runtime and os.path.isdir(runtime) else \
        Path(tempfile.gettempdir()) / f"flockfl-mlflow-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base / (hashlib.sha256(str(db.resolve()).encode()).hexdigest()[:32] + ".lock")


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``, whose store exists when this returns.

    MLflow creates a missing SQLite store's schema when a client first touches it; two processes
    doing that at once both run the migration and one fails (``table ... already exists``). So
    the first touch of a SQLite store in each process holds an exclusive lock (:func:`_store_lock`,
    a per-user folder, not beside the database: a project's root keeps no stray lock file): one
    process creates the schema (and the Default experiment), the others wait and then open a
    complete store. Other URIs are opened as is."""
    from mlflow.tracking import MlflowClient

    db = _sqlite_file(uri)
    with _READY_LOCK:
        if db is not None and not (uri in _READY and db.exists()):
            db.parent.mkdir(parents=True, exist_ok=True)
            with open(_store_lock(db), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                client.search_experiments(max_results=1)  # creates the tracking store (and schema)
                client.search_registered_models(max_results=1)  # and the registry store on it
        _READY.add(uri)
    return MlflowClient(tracking_uri=uri)


_PREFETCHED: dict[str, threading.Thread] = {}


def prefetch(uri: str) -> threading.Thread:
    """Import MLflow and open the store ``uri`` on a background thread (~1.5 s on 2 cores), so
    that the run's tracker finds both ready (once per store and process). A SQLite store that
    does not exist yet is left alone: it is created with the run, once the data and the
    partition have been checked."""
    if uri in _PREFETCHED:
        return _PREFETCHED[uri]

    def work() -> None:
        try:
            import mlflow  # noqa: F401
            from mlflow.tracking import MlflowClient  # noqa: F401

            db = _sqlite_file(uri)
            if db is None or db.exists():
                open_store(uri)
        except Exception:  # the tracker opening the store reports the same error, in order
            pass

    thread = _PREFETCHED[uri] = threading.Thread(target=work, name="flockfl-mlflow-prefetch", daemon=True)
    thread.start()
    return thread


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
    charts, and holding flockfl's results view of its runs table (:func:`save_results_view`).
    Safe when several processes create the same experiment at once."""
    import json

    import mlflow
    from mlflow.exceptions import MlflowException

    client = open_store(uri or mlflow.get_tracking_uri())
    exp = client.get_experiment_by_name(name)
    if exp is None:
        now = int(time.time() * 1000)
        view = json.dumps({"name": RESULTS_VIEW_NAME, "createdAt": now, "updatedAt": now,
                           "state": json.dumps(results_view_state(), separators=(",", ":"))}, separators=(",", ":"))
        try:
            return client.create_experiment(name, tags={KIND_TAG: TRAINING_KIND, VIEW_TAG + RESULTS_VIEW: view})
        except MlflowException as err:  # another process created it in between
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    _mark_training(client, exp)
    if exp.lifecycle_stage == "active" and VIEW_TAG + RESULTS_VIEW not in exp.tags:
        save_results_view(client, exp.experiment_id)
    return exp.experiment_id


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


# ---------------------------------------------------------------------- metric names in MLflow
# A run's history rows and JSON summary keep flockfl's names (a contract); MLflow gets them
# sorted for a person: the headline series (accuracy, loss, ari, num_clusters, the round's
# accounting) under their own names, which sort together in every list MLflow shows (the run's
# metrics, the runs table's column chooser), and the long tail under a prefix. MLflow 3.17's
# charts make a section of everything before a name's last "/", and show the sections with a
# prefix first (sorted), the unprefixed ones ("Model metrics") after them:
#   F__TESTSET__AVERAGE, F_min__TESTSET, ... -> eval/<the same name>   (one "eval" section:
#       every protocol's series, every evaluated round; charts named as in the summary)
#   cluster/J/accuracy, cluster/J/clients   -> as they are              (a section per cluster)
# Numbers a run has once are params, not one-point metrics: the last round's report modes
# (F__TESTSET__AVERAGE__REPORT, under that name), the partition's measures (partition_*) and
# the pre-federation step's cost (pre_federation_*). :func:`summary_metrics` reads both ways back.
EVAL_PREFIX = "eval/"


def _report_mode(key: str) -> bool:
    return key.count("__") == 3


def metric_name(key: str) -> str:
    """The MLflow metric name of a history row's key."""
    return EVAL_PREFIX + key if "__" in key and "/" not in key else key


def row_key(name: str) -> str:
    """The history row's key of an MLflow metric name (the inverse of :func:`metric_name`;
    a name from before the renaming is returned as is)."""
    rest = name[len(EVAL_PREFIX):]
    return rest if name.startswith(EVAL_PREFIX) and "__" in rest and "/" not in rest else name


ONCE_PREFIXES = ("partition_", "pre_federation_")


def summary_metrics(metrics: dict[str, float], params: dict[str, str]) -> dict[str, float]:
    """A run's final values under flockfl's names, whichever way the run was logged: its
    metrics renamed back (:func:`row_key`) plus the numbers logged once as params (report modes,
    partition measures, pre-federation cost). Runs logged before the renaming have them as
    metrics already, under these names."""
    out = {row_key(k): v for k, v in metrics.items()}
    for k, v in params.items():
        if k in out or not (_report_mode(k) or k.startswith(ONCE_PREFIXES)):
            continue
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------------- where the code came from

_SOURCE: dict[str, dict[str, str]] = {}


def _git_root(start: Path) -> Optional[Path]:
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d
    return None


def source_tags(folder: Optional[Path] = None) -> dict[str, str]:
    """``mlflow.source.git.commit`` (and ``.branch``) and ``flockfl.git_dirty`` ("true" when
    tracked files differ from that commit; untracked files do not count) of the git work tree
    holding ``folder``, by default the one holding flockfl's code, else the working directory's;
    {} outside git, without a git binary, or when git refuses the folder. One ``git status`` per
    work tree and process (the code a process runs is what it imported), without taking the
    index lock (others may be committing)."""
    import subprocess

    if folder is not None:
        root = _git_root(Path(folder).resolve())
    else:
        root = _git_root(Path(__file__).resolve().parent) or _git_root(Path.cwd().resolve())
    if root is None:
        return {}
    if str(root) in _SOURCE:
        return _SOURCE[str(root)]
    tags: dict[str, str] = {}
    try:
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain=v2", "--branch",
                              "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        res = None
    if res is not None and res.returncode == 0:
        head = {}
        dirty = False
        for line in res.stdout.splitlines():
            if line.startswith("# branch."):
                k, _, v = line[len("# branch."):].partition(" ")
                head[k] = v
            elif line.strip():
                dirty = True
        commit = head.get("oid", "")
        if len(commit) == 40:  # not "(initial)": a repository without a commit has nothing to name
            tags["mlflow.source.git.commit"] = commit
            if head.get("head") and head["head"] != "(detached)":
                tags["mlflow.source.git.branch"] = head["head"]
            tags["flockfl.git_dirty"] = "true" if dirty else "false"
    _SOURCE[str(root)] = tags
    return tags


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
            _mark_training(self.client, self.client.get_experiment(self.experiment_id))
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

    def log_round(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        step = int(row["round"])
        values = _numeric(row)
        once = {k: v for k, v in values.items() if _report_mode(k)}  # the last round's report modes
        if once:
            self.log_once(once)
        metrics = [Metric(metric_name(k), v, ts, step) for k, v in values.items() if k not in once]
        for a in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[a : a + 1000])

    def log_rounds(self, rows: list[dict[str, Any]]) -> None:
        """Log the history rows this run does not hold yet: after a resume, or a fallback to an
        older checkpoint, a recomputed round was logged already and is not logged twice."""
        for row in rows:
            if row["round"] > self.logged:
                self.log_round(row)
                self.logged = int(row["round"])

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

        logged, versions = self._exported(registered_name)
        k = next(iter(stacked.values())).shape[0]
        reqs = [f"torch=={torch.__version__.split('+')[0]}"]
        # the registry prints "Created version ..." to stderr for every version: keep it quiet, in
        # this thread only (a sweep's next run and its log lines go on meanwhile: tasks/quiet.py)
        # (and the pickle format's warning about unpickling untrusted files: these are the run's own)
        # torch.export traces through process-global state: one model at a time (flockfl sweep --parallel)
        with _EXPORT_LOCK, mlflow.start_run(run_id=self.run_id), quiet_stderr(), \
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

    def _exported(self, registered_name: Optional[str]) -> tuple[dict[int, str], dict[int, str]]:
        """What this run already holds: cluster → URI of its logged model (a model a kill left
        half written is deleted), and cluster → its registered version."""
        from mlflow.entities import LoggedModelStatus

        logged: dict[int, str] = {}
        token = None
        while True:
            page = self.client.search_logged_models([self.experiment_id], filter_string=f"source_run_id = '{self.run_id}'",
                                                    page_token=token)
            for m in page:
                if not m.name.startswith("cluster_"):
                    continue
                if m.status == LoggedModelStatus.READY:
                    logged[int(m.name.split("_", 1)[1])] = m.model_uri
                else:
                    self.client.delete_logged_model(m.model_id)
            token = page.token
            if not token:
                break
        versions: dict[int, str] = {}
        if registered_name:
            for v in self.client.search_model_versions(f"run_id = '{self.run_id}'"):
                if v.name == registered_name and "cluster" in v.tags:
                    versions[int(v.tags["cluster"])] = str(v.version)
        return logged, versions

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class TrackingSkipped(RuntimeError):
    """A tracking call not made because an earlier one failed (that error is the cause)."""


_OPEN_TRACKERS: "set[BackgroundTracker]" = set()


class BackgroundTracker:
    """A :class:`Tracker` whose calls run in order on one background thread.

    Creating it returns at once: the thread imports MLflow, opens the store and creates (or
    re-opens) the run while the caller loads data and trains. Every call is queued and returns a
    ``Future``; ``run_id`` waits for the run to exist, ``check`` re-raises a failed call without
    waiting, ``close`` waits for everything queued. Once a call has failed the later ones are
    skipped (:class:`TrackingSkipped`), so a run never reads FINISHED after a lost log; only
    ``finish`` with another status still goes through. ``on_open`` runs on the thread with the
    new :class:`Tracker` (e.g. to write the new run id beside the checkpoints). ``seconds``: the
    thread's time per call name. A process that exits normally closes its trackers first
    (``atexit``); a killed one loses only what was queued, which a resume logs again.
    """

    def __init__(self, *args, on_open: Optional[Callable[[Tracker], None]] = None, **kwargs):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._tracker: Optional[Tracker] = None
        self.seconds: dict[str, float] = {}
        self._thread = threading.Thread(target=self._work, name="flockfl-tracking", daemon=True)
        self._thread.start()
        self._closed = False
        _OPEN_TRACKERS.add(self)

        def open_run(_) -> Tracker:
            self._tracker = Tracker(*args, **kwargs)
            if on_open:
                on_open(self._tracker)
            return self._tracker

        self._opened = self.submit(open_run, "open")

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, name, always = item
            if not fut.set_running_or_notify_cancel():
                continue
            if (self._error is not None and not always) or (self._tracker is None and name != "open"):
                err = TrackingSkipped(f"tracking call {name!r} skipped: an earlier one failed")
                err.__cause__ = self._error
                fut.set_exception(err)
                continue
            t = time.perf_counter()
            try:
                fut.set_result(fn(self._tracker))
            except BaseException as err:  # kept for check()/close(); the thread goes on
                self._error = self._error or err
                fut.set_exception(err)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def submit(self, fn: Callable[[Tracker], Any], name: str = "call", always: bool = False) -> Future:
        """Run ``fn(tracker)`` on the thread after everything queued before it."""
        if self._closed:
            raise RuntimeError("BackgroundTracker is closed")
        fut: Future = Future()
        self._queue.put((fut, fn, name, always))
        return fut

    @property
    def tracker(self) -> Tracker:
        """The open :class:`Tracker` (waits for it; raises if opening failed)."""
        return self._opened.result()

    @property
    def run_id(self) -> str:
        return self.tracker.run_id

    @property
    def experiment_id(self) -> str:
        return self.tracker.experiment_id

    def check(self) -> None:
        """Re-raise the first failed call, if any (does not wait)."""
        if self._error is not None:
            raise self._error

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every queued call and stop the thread; re-raise the first failure."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            _OPEN_TRACKERS.discard(self)
        if raise_errors:
            self.check()

    def _queued(name: str, always: Callable[..., bool] = lambda *a, **k: False):  # noqa: N805
        def call(self, *args, **kwargs) -> Future:
            return self.submit(lambda t: getattr(t, name)(*args, **kwargs), name, always(*args, **kwargs))

        call.__name__ = name
        call.__doc__ = f"Queue :meth:`Tracker.{name}`."
        return call

    log_rounds = _queued("log_rounds")
    catch_up = _queued("catch_up")
    log_values = _queued("log_values")
    log_once = _queued("log_once")
    log_pre_federation = _queued("log_pre_federation")
    log_dict = _queued("log_dict")
    log_text = _queued("log_text")
    log_artifact = _queued("log_artifact")
    set_tags = _queued("set_tags")
    log_models = _queued("log_models")
    # a FAILED/KILLED status is recorded even after a failed call; FINISHED only if all went through
    finish = _queued("finish", always=lambda status="FINISHED": status != "FINISHED")
    del _queued


def close_all() -> None:
    """Wait for every tracker this process still has open (an exit handler: nothing queued is
    lost on a normal exit). Failures were reported where they happened."""
    for t in list(_OPEN_TRACKERS):
        t.close(raise_errors=False)


atexit.register(close_all)
