"""``flockfl report RUN_OR_PARENT``: one report over a run, a sweep or any parent run's children.

RUN_OR_PARENT is an MLflow run id (a parent: the report covers the runs whose
``mlflow.parentRunId`` tag names it; otherwise that one run), a run directory (``run.json``) or a
sweep directory (``sweep.json``). The report reads everything from MLflow: final metrics, the
per-round histories, each run's ``assignments.npz`` artifact (falling back to the copy in its
run directory) and, for runs with an ``algorithm.*=auto`` key, its ``auto_choices.json`` (the
decisions and the criterion's curves). It writes, in ``--out`` (default
``runs/reports/<name>-<id8>/``):

- ``report.md`` (and with ``--html`` a self-contained ``report.html``, images inlined);
- ``final_metrics.csv`` (one row per run) and, when sweep combinations have several seeds,
  ``combination_metrics.csv`` (mean and std per combination);
- ``accuracy_per_round.png``, ``ari_per_round.png``, ``cluster_assignments.png``,
  ``accuracy_vs_comm.png`` and ``accuracy_vs_sim_time.png``;
- where some run chose a threshold or cluster count itself: ``auto_choices.csv`` (every
  decision) and ``auto_choice_curves.png`` (each run's latest criterion curve, side by side);

and logs the folder to MLflow under ``report/`` of the parent (or of the single run) unless
``--no-log``. This module stays light at import: ``flockfl`` imports it to build its parser.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Optional

from flows.render import (AUTO_FIGURE, AUTO_HEADING, RunSummary, auto_table, combination_table, combinations, markdown_table,
                          run_table, write_csvs)
from flows.render_documents import _sections, render_html, render_markdown
from flows.render_figures import draw_figures

COMBO_TAG = "flockfl.sweep.combo"
SEED_TAG = "flockfl.seed"
HISTORY_KEYS = ("accuracy", "loss", "ari", "comm_bytes", "sim_time", "bytes_total")
FIGURES = ("accuracy_per_round.png", "ari_per_round.png", "cluster_assignments.png",
           "accuracy_vs_comm.png", "accuracy_vs_sim_time.png", AUTO_FIGURE)
OUTPUTS = ("report.md", "report.html", "final_metrics.csv", "combination_metrics.csv", "auto_choices.csv", *FIGURES)
AUTO_ARTIFACT = "auto_choices.json"  # what flows.run_tracking logs for algorithm.*=auto: {"decisions": [...]}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="a report (tables, curves, assignment heat-maps) over a run, a sweep or a parent run's children",
        description="Report over one MLflow run, or over every child run of a parent (a sweep). "
                    "RUN_OR_PARENT is an MLflow run id, a run directory (with run.json) or a sweep directory "
                    "(with sweep.json). The report is written to --out and logged to MLflow under report/.")
    p.add_argument("target", metavar="RUN_OR_PARENT", help="MLflow run id, run directory or sweep directory")
    p.add_argument("--html", action="store_true", help="also write a self-contained report.html (images inlined)")
    p.add_argument("--out", help="report folder (default runs/reports/<name>-<id[:8]>)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: the one the run or sweep directory names, "
                                          "else MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    p.set_defaults(handler=cmd_report)


# ---------------------------------------------------------------------- what the report is over


def resolve_target(target: str, cli_uri: Optional[str]) -> tuple[str, str]:
    """(tracking URI, MLflow run id) for a run id, a run directory or a sweep directory.

    A ``--tracking-uri`` given on the command line wins over the directory's (as for ``flockfl
    resume``): the store may have moved since the run was made."""
    import json

    from flockfl.errors import UserError
    from flows.tracking.store import resolve_tracking_uri

    path = Path(target)
    if path.is_dir():
        for name, key in (("sweep.json", "parent_run_id"), ("run.json", "mlflow_run_id")):
            f = path / name
            if f.exists():
                try:
                    info = json.loads(f.read_text())
                except ValueError as err:
                    raise UserError(f"{f} is not valid JSON ({err}); it was not written by flockfl") from None
                if not info.get(key):
                    raise UserError(f"{f} has no {key}: the run was not tracked in MLflow "
                                    f"(tracking.enabled: false), so there is nothing to report")
                return resolve_tracking_uri(cli_uri, info.get("tracking_uri")), str(info[key])
        raise UserError(f"{path} holds neither run.json (a flockfl run) nor sweep.json (a flockfl sweep)")
    if not re.fullmatch(r"[0-9a-fA-F]{16,64}", target):
        raise UserError(f"{target!r} is neither a run or sweep directory nor an MLflow run id")
    return resolve_tracking_uri(cli_uri, None), target.lower()


def _child_runs(client, parent_id: str) -> list:
    """Every active run whose mlflow.parentRunId is ``parent_id``, in any experiment, oldest first."""
    from mlflow.entities import ViewType

    exp_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY, max_results=50000)]
    runs, token = [], None
    while exp_ids:
        page = client.search_runs(exp_ids, filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  run_view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token,
                                  order_by=["attributes.start_time ASC"])
        runs += list(page)
        token = page.token
        if not token:
            break
    return runs


def _artifacts(client, run) -> Optional[set[str]]:
    """The paths at the top of the run's artifacts; None when the store cannot be listed."""
    try:
        return {a.path for a in client.list_artifacts(run.info.run_id)}
    except Exception:  # an unreachable artifact store: the run directory may still have what is needed
        return None


def _assignments(client, run, tmp: Path, listed: Optional[set[str]]) -> tuple[Optional[tuple], str]:
    """The run's (history, groups) from its ``assignments.npz`` artifact, else from its run
    directory; (None, why) when neither is there."""
    import numpy as np

    candidates = []
    try:
        if listed and "assignments.npz" in listed:
            dst = tmp / run.info.run_id
            dst.mkdir(parents=True, exist_ok=True)
            candidates.append(Path(client.download_artifacts(run.info.run_id, "assignments.npz", str(dst))))
    except Exception:  # an unreachable artifact store: the run directory may still have it
        pass
    run_dir = run.data.tags.get("flockfl.run_dir")
    if run_dir:
        candidates.append(Path(run_dir) / "assignments.npz")
    for f in candidates:
        if f.is_file():
            with np.load(f) as z:
                return (np.asarray(z["history"]), np.asarray(z["groups"])), ""
    return None, ("no assignments.npz artifact" + (f" and none in {run_dir}" if run_dir else " and no run directory"))


def _auto_choices(client, run, tmp: Path, listed: Optional[set[str]]) -> tuple[list[dict], str]:
    """The run's ``algorithm.*=auto`` decisions from its ``auto_choices.json`` artifact, oldest
    first. A run without the artifact and without an auto key gives ([], ""): most runs choose
    nothing, and the report stays silent about them; one whose params say auto but that has no
    readable artifact (still running, failed before its end, a store that cannot be reached)
    gives ([], why), so the report says why its evidence is missing."""
    import json

    auto_keys = sorted(k for k, v in run.data.params.items() if k.startswith("algorithm.") and v == "auto")
    keys = ", ".join(f"{k}=auto" for k in auto_keys)
    if listed is None:
        return [], (f"{keys}, but its artifacts could not be listed" if auto_keys else "")
    if AUTO_ARTIFACT not in listed:
        return [], (f"{keys}, but no {AUTO_ARTIFACT} artifact (it is logged when the run finishes; "
                    f"status {run.info.status})" if auto_keys else "")
    dst = tmp / run.info.run_id
    dst.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(Path(client.download_artifacts(run.info.run_id, AUTO_ARTIFACT, str(dst))).read_text())
    except Exception as err:  # a download or a JSON error: one line, the rest of the report still stands
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        return [], f"{AUTO_ARTIFACT} could not be read ({msg})"
    decisions = data.get("decisions") if isinstance(data, dict) else None
    if not isinstance(decisions, list) or not all(
            isinstance(d, dict) and {"key", "k", "round", "floor"} <= set(d) for d in decisions):
        return [], f"{AUTO_ARTIFACT} is not a list of decisions (each with key, k, round and floor)"
    return decisions, ""


def load_run(client, run, tmp: Path) -> RunSummary:
    """One run under flockfl's names, however it was logged: MLflow's names (``eval/...``, params
    for the numbers logged once) are read back by ``flows.tracking.names``, and runs logged before them
    read as they are."""
    from flows.tracking.names import metric_name, summary_metrics

    hist = {}
    for key in HISTORY_KEYS:
        name = next((n for n in (metric_name(key), key) if n in run.data.metrics), None)
        if name is not None:
            hist[key] = {int(m.step): float(m.value) for m in client.get_metric_history(run.info.run_id, name)}
    if "comm_bytes" not in hist and "bytes_total" in hist:  # runs from before comm_bytes: its running sum
        total, hist["comm_bytes"] = 0.0, {}
        for step in sorted(hist["bytes_total"]):
            total += hist["bytes_total"][step]
            hist["comm_bytes"][step] = total
    tags = run.data.tags
    name = run.info.run_name or tags.get("mlflow.runName") or run.info.run_id
    listed = _artifacts(client, run)
    assignments, note = _assignments(client, run, tmp, listed)
    choices, auto_note = _auto_choices(client, run, tmp, listed)
    return RunSummary(run_id=run.info.run_id, name=name, status=run.info.status, group=tags.get(COMBO_TAG) or name,
                      seed=tags.get(SEED_TAG) or run.data.params.get("seed"),
                      final=summary_metrics(dict(run.data.metrics), dict(run.data.params)),
                      history=hist, assignments=assignments, assignments_note=note, params=dict(run.data.params),
                      auto_choices=choices, auto_note=auto_note)


# ---------------------------------------------------------------------- the command


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("_") or "run"


def build_report(client, root, runs: list[RunSummary], out: Path, uri: str, html: bool) -> dict[str, Any]:
    """Write the report folder; returns its parts (markdown text, files, figure notes)."""
    import datetime as dt

    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:  # a report written again here must not keep a figure from last time
        (out / name).unlink(missing_ok=True)
    name = root.info.run_name or root.info.run_id
    single = len(runs) == 1 and runs[0].run_id == root.info.run_id
    title = f"flockfl report: {name} ({root.info.run_id})"
    exp = client.get_experiment(root.info.experiment_id)
    meta = [("runs", "1 (a single run)" if single else f"{len(runs)} child runs of {name}"),
            ("MLflow experiment", f"{exp.name} (id {exp.experiment_id})"),
            ("tracking URI", uri),
            ("generated", dt.datetime.now().isoformat(timespec="seconds"))]
    if single and root.data.params.get("algorithm.name"):
        meta.insert(1, ("algorithm", root.data.params["algorithm.name"]))
    figures = draw_figures(runs, out)
    csvs = write_csvs(runs, out)
    blocks = _sections(title, meta, runs, figures)
    md = render_markdown(blocks)
    (out / "report.md").write_text(md)
    files = [out / "report.md", *csvs, *[p for p in figures.values() if isinstance(p, Path)]]
    if html:
        (out / "report.html").write_text(render_html(blocks, out))
        files.insert(1, out / "report.html")
    return {"title": title, "blocks": blocks, "files": files, "figures": figures}


def cmd_report(args) -> int:
    import os
    import tempfile

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from flockfl.errors import UserError

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per download otherwise
    uri, run_id = resolve_target(args.target, args.tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        root = client.get_run(run_id)
    except MlflowException:
        raise UserError(f"MLflow run {run_id} not found in {uri}; pass --tracking-uri (the store the run was "
                        f"logged to)") from None
    children = _child_runs(client, run_id)
    name = root.info.run_name or run_id
    if not children and not any(k in root.data.metrics for k in ("accuracy", "loss", "round")):
        raise UserError(f"MLflow run {name} ({run_id}) has no child runs and no metrics of its own: "
                        f"nothing to report yet (is the sweep still starting?)")
    with tempfile.TemporaryDirectory(prefix="flockfl-report-") as tmp:
        runs = [load_run(client, r, Path(tmp)) for r in (children or [root])]
    out = Path(args.out or f"runs/reports/{_safe(name)}-{run_id[:8]}")
    report = build_report(client, root, runs, out, uri, args.html)

    print(f"{report['title']}\n\nFinal metrics\n")
    print(markdown_table(*run_table(runs)))
    if combinations(runs):
        print("\nPer combination (mean ± std over seeds)\n")
        print(markdown_table(*combination_table(runs)))
    if any(r.auto_choices for r in runs):
        print(f"\n{AUTO_HEADING}\n")
        print(markdown_table(*auto_table(runs)))
    print()
    for fname, fig in report["figures"].items():
        if not isinstance(fig, Path):
            print(f"note: {fname[:-4].replace('_', ' ')} not drawn: {fig}")
    print(f"report written to {out.resolve()}/ ({', '.join(p.name for p in report['files'])})")
    if args.no_log:
        print("not logged to MLflow (--no-log)")
    else:
        try:
            client.log_artifacts(run_id, str(out), "report")
        except Exception as err:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"flockfl: warning: the report could not be logged to MLflow run {run_id}: {msg}", file=sys.stderr)
            return 0
        where = "report.html" if args.html else "report.md"
        print(f"logged to MLflow run {name} ({run_id}): {root.info.artifact_uri.rstrip('/')}/report")
        from flows.tracking.view import ui_url

        print(f"browse it: flockfl ui --tracking-uri {uri}, then open "
              f"{ui_url('http://127.0.0.1:5000', root.info.experiment_id, run_id, f'report/{where}')}")
    return 0
