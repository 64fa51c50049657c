"""Where a run's MLflow store is and how it is opened.

The tracking URI is resolved once (:func:`resolve_tracking_uri`: the command line, then the
config, then ``MLFLOW_TRACKING_URI``, then ``./mlflow.db``). The store is opened with
:func:`open_store`: a new SQLite store is created by one process at a time, so ``flockfl run``s
started together on it all work. :func:`prefetch` imports MLflow and opens the store on a
background thread before the run is known. Experiments are made by :func:`ensure_experiment`:
a training experiment, not a GenAI one, holding flockfl's results view of its runs
(flows/tracking/view.py).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Optional

from flows.tracking.view import RESULTS_VIEW, RESULTS_VIEW_NAME, VIEW_TAG, results_view_state, save_results_view

DEFAULT_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(cli_uri: Optional[str], cfg_uri: Optional[str]) -> str:
    """--tracking-uri, then tracking.uri, then MLFLOW_TRACKING_URI, then ./mlflow.db (made absolute)."""
    uri = cli_uri or cfg_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


# MLflow 3's UI shows an experiment by its kind: as a GenAI experiment (traces, judges) or a
# training one (runs and their charts). Earlier 3.x UIs read it from this tag (later ones need
# a query parameter in the link as well: flows/tracking/view.py)
KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"

_READY: set[str] = set()  # store URIs this process has opened (schema known to exist)
_READY_LOCK = threading.Lock()


def sqlite_file(uri: str) -> Optional[Path]:
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


TEMPLATE_ENV = "FLOCKFL_STORE_TEMPLATE"


def schema_template() -> Optional[Path]:
    """Where the empty MLflow schema of this MLflow and SQLAlchemy is kept: ``FLOCKFL_STORE_TEMPLATE``
    (``off``: none), else ``$XDG_CACHE_HOME/flockfl/`` (else ``~/.cache/flockfl/``)."""
    import mlflow
    import sqlalchemy

    from flockfl.cachedir import cache_file

    return cache_file(TEMPLATE_ENV, f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}-schema.db")


def _build_template(path: Path) -> None:
    """MLflow's own schema creation (its SQLAlchemy engine, ``create_all`` then every Alembic
    migration: ~2.2 s on 2 cores) on an empty database, written to ``path`` atomically. No row
    is in it: the Default experiment is made by the store that opens a copy, as on a new store."""
    import tempfile

    from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        work = Path(tmp) / "schema.db"
        engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{work}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(work, path)  # a concurrent run reads no file or the whole one


def _copy_schema(db: Path) -> None:
    """Start the new SQLite store ``db`` as a copy of the empty schema (:func:`schema_template`,
    built by the first store of this MLflow version), so that MLflow finds its tables and only
    adds the Default experiment: 2.2 s of migrations once per machine, not per store. Any
    failure leaves ``db`` absent and MLflow creates the schema itself, as without a template."""
    import shutil

    try:
        template = schema_template()
        if template is None:
            return
        if not template.exists():
            _build_template(template)
        with open(template, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":  # not a database: MLflow makes the schema
                return
        part = db.with_name(db.name + ".flockfl-new")
        try:
            shutil.copyfile(template, part)
            os.replace(part, db)
        finally:
            part.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - the template only saves time; MLflow's own path follows
        return


def open_store(uri: str):
    """An ``MlflowClient`` on ``uri``, whose store exists when this returns.

    MLflow creates a missing SQLite store's schema when a client first touches it; two processes
    doing that at once both run the migration and one fails (``table ... already exists``). So
    the first touch of a SQLite store in each process holds an exclusive lock (:func:`_store_lock`,
    a per-user folder, not beside the database: a project's root keeps no stray lock file): one
    process creates the schema (and the Default experiment), the others wait and then open a
    complete store. The schema is copied from this machine's empty one (:func:`_copy_schema`).
    Other URIs are opened as is."""
    from mlflow.tracking import MlflowClient

    db = sqlite_file(uri)
    with _READY_LOCK:
        if db is not None and not (uri in _READY and db.exists()):
            db.parent.mkdir(parents=True, exist_ok=True)
            with open(_store_lock(db), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not db.exists():
                    _copy_schema(db)
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

            db = sqlite_file(uri)
            if db is None or db.exists():
                open_store(uri)
        except Exception:  # the tracker opening the store reports the same error, in order
            pass

    thread = _PREFETCHED[uri] = threading.Thread(target=work, name="flockfl-mlflow-prefetch", daemon=True)
    thread.start()
    return thread


def mark_training(client, exp) -> None:
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
    mark_training(client, exp)
    if exp.lifecycle_stage == "active" and VIEW_TAG + RESULTS_VIEW not in exp.tags:
        save_results_view(client, exp.experiment_id)
    return exp.experiment_id
