"""``flockfl ui``: the MLflow UI on 127.0.0.1, opened on an experiment's runs.

The link it prints (and opens, where there is a display) shows the experiment's runs in
flockfl's results view: a runs table whose columns are accuracy, ARI, the number of clusters
and the run's duration (``flows.tracking.view.save_results_view``; MLflow's own default shows no
metric). The experiment is ``--experiment`` (a name or an id), else the one with the latest
run. The server runs in a process group of its own under a guard (``flows.server.start_group``):
Ctrl-C, SIGTERM or even SIGKILL of flockfl stops it and every process it started. This module
stays light at import: ``flockfl`` imports it to build its parser.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from flockfl.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("ui", help="serve the MLflow UI on 127.0.0.1, opened on an experiment's runs "
                                  "(accuracy, ARI, clusters and duration as columns)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--experiment", "-e", metavar="NAME_OR_ID",
                   help="the experiment whose runs the link opens (default: the one with the latest run)")
    p.add_argument("--workers", type=int, default=1, help="MLflow server worker processes (default 1)")
    p.add_argument("--open", action=argparse.BooleanOptionalAction, default=None,
                   help="open the link in a browser (default: when there is a display, not over ssh)")
    p.set_defaults(handler=cmd_ui)


def pick_experiment(client, wanted: Optional[str]):
    """The experiment ``wanted`` names (a name, else an id), or with None the active experiment
    holding the most recently started active run; None when the store has no run at all."""
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    if wanted:
        exp = client.get_experiment_by_name(wanted)
        if exp is None and wanted.isdigit():
            try:
                exp = client.get_experiment(wanted)
            except MlflowException:
                exp = None
        if exp is None or exp.lifecycle_stage != "active":
            names = sorted(e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY, max_results=1000))
            raise UserError(f"--experiment {wanted}: no such experiment in the store; it has: "
                            f"{', '.join(names) or '(none)'}")
        return exp
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY, max_results=50000)]
    latest = []
    for a in range(0, len(ids), 100):  # search_runs takes at most 100 experiments at a time
        latest += client.search_runs(ids[a:a + 100], max_results=1, order_by=["attributes.start_time DESC"])
    if not latest:
        return None
    return client.get_experiment(max(latest, key=lambda r: r.info.start_time or 0).info.experiment_id)


def _metric_keys(client, experiment_id: str, runs: int = 100) -> set[str]:
    """The metric names of the experiment's latest ``runs`` runs."""
    got = client.search_runs([experiment_id], max_results=runs, order_by=["attributes.start_time DESC"])
    return {k for r in got for k in r.data.metrics}


def _display() -> bool:
    """Whether a browser opened from here would show up in front of a person (not a text
    browser taking over the terminal of an ssh session)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def cmd_ui(args) -> int:
    import signal
    import subprocess

    from flows.server import check_port, on_sigterm, start_group, stop_group, wait_until_up
    from flows.tracking.store import resolve_tracking_uri
    from flows.tracking.view import ui_url

    port = args.port
    check_port(port, "an MLflow UI")
    uri = resolve_tracking_uri(args.tracking_uri, None)
    base = f"http://127.0.0.1:{port}"
    # one worker and no job runner: a UI for one person answers in seconds instead of ~45 s on 2
    # cores (MLflow's default starts 4 uvicorn workers and a background job executor)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri", uri,
           "--workers", str(args.workers)]
    env = {**os.environ}
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    stop = {"by": "Ctrl-C"}
    old = on_sigterm(stop)
    proc = start_group(cmd, grace=10, env=env)
    try:
        t0 = time.monotonic()
        # while the server starts (10-30 s on 2 cores): the experiment, and its results view
        link, what = _results_link(uri, base, args.experiment)
        wait_until_up(proc, base, "MLflow server", lambda: "; its output is above")
        print(f"MLflow UI ready in {time.monotonic() - t0:.0f}s (store {uri}); Ctrl-C stops it.\n"
              f"  {what}: {link}\n"
              f"  every experiment: {ui_url(base)}", flush=True)
        if args.open or (args.open is None and _display()):
            import webbrowser

            webbrowser.open(link)
        return proc.wait()
    except KeyboardInterrupt:
        stop_group(proc)
        print(f"flockfl: MLflow UI stopped ({stop['by']})", file=sys.stderr)
        return 0
    finally:
        stop_group(proc)
        signal.signal(signal.SIGTERM, old)


def _results_link(uri: str, base: str, wanted: Optional[str]) -> tuple[str, str]:
    """(link, what it shows): the experiment's runs in flockfl's results view, or the
    experiment list when the store has no run yet."""
    from flows.tracking.store import open_store, sqlite_file
    from flows.tracking.view import save_results_view, ui_url

    db = sqlite_file(uri)
    if db is not None and not db.exists():
        if wanted:
            raise UserError(f"--experiment {wanted}: the store {db} does not exist yet (no run was logged to it)")
        return ui_url(base), f"no runs yet in {db}; the experiments"
    client = open_store(uri)
    exp = pick_experiment(client, wanted)
    if exp is None:
        return ui_url(base), "no runs yet; the experiments"
    keys = _metric_keys(client, exp.experiment_id)
    view = save_results_view(client, exp.experiment_id, keys)
    return ui_url(base, exp.experiment_id, view=view), f"runs of {exp.name}"
