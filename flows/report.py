"""``flock report RUN_OR_PARENT``: one report over a run, a sweep or any parent run's children.

RUN_OR_PARENT is an MLflow run id (a parent: the report covers the runs whose
``mlflow.parentRunId`` tag names it; otherwise that one run), a run directory (``run.json``) or a
sweep directory (``sweep.json``). The report reads everything from MLflow: final metrics, the
per-round histories, and each run's ``assignments.npz`` artifact (falling back to the copy in its
run directory). It writes, in ``--out`` (default ``runs/reports/<name>-<id8>/``):

- ``report.md`` (and with ``--html`` a self-contained ``report.html``, images inlined);
- ``final_metrics.csv`` (one row per run) and, when sweep combinations have several seeds,
  ``combination_metrics.csv`` (mean and std per combination);
- ``accuracy_per_round.png``, ``ari_per_round.png``, ``cluster_assignments.png``,
  ``accuracy_vs_comm.png`` and ``accuracy_vs_sim_time.png``;

and logs the folder to MLflow under ``report/`` of the parent (or of the single run) unless
``--no-log``. This module stays light at import: ``flock`` imports it to build its parser.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

COMBO_TAG = "flockfl.sweep.combo"
SEED_TAG = "flockfl.seed"
HISTORY_KEYS = ("accuracy", "loss", "ari", "comm_bytes", "sim_time", "bytes_total")
MAX_HEATMAP_PANELS = 48
FIGURES = ("accuracy_per_round.png", "ari_per_round.png", "cluster_assignments.png",
           "accuracy_vs_comm.png", "accuracy_vs_sim_time.png")
OUTPUTS = ("report.md", "report.html", "final_metrics.csv", "combination_metrics.csv", *FIGURES)


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


@dataclass
class RunSummary:
    """One run as the report sees it: final metrics, histories (step → value) and assignments."""

    run_id: str
    name: str
    status: str
    group: str                     # sweep combination label, or the run's own name
    seed: Optional[str]
    final: dict[str, float]
    history: dict[str, dict[int, float]]
    assignments: Optional[tuple[Any, Any]] = None  # (history rounds × clients, groups)
    assignments_note: str = ""
    params: dict[str, str] = field(default_factory=dict)

    @property
    def rounds(self) -> Optional[int]:
        if "round" in self.final:
            return int(self.final["round"])
        steps = [s for k in ("accuracy", "loss") for s in self.history.get(k, {})]
        return max(steps) if steps else None


def resolve_target(target: str, cli_uri: Optional[str]) -> tuple[str, str]:
    """(tracking URI, MLflow run id) for a run id, a run directory or a sweep directory.

    A ``--tracking-uri`` given on the command line wins over the directory's (as for ``flock
    resume``): the store may have moved since the run was made."""
    import json

    from flockfl.errors import UserError
    from tasks.tracking import resolve_tracking_uri

    path = Path(target)
    if path.is_dir():
        for name, key in (("sweep.json", "parent_run_id"), ("run.json", "mlflow_run_id")):
            f = path / name
            if f.exists():
                try:
                    info = json.loads(f.read_text())
                except ValueError as err:
                    raise UserError(f"{f} is not valid JSON ({err}); it was not written by flock") from None
                if not info.get(key):
                    raise UserError(f"{f} has no {key}: the run was not tracked in MLflow "
                                    f"(tracking.enabled: false), so there is nothing to report")
                return resolve_tracking_uri(cli_uri, info.get("tracking_uri")), str(info[key])
        raise UserError(f"{path} holds neither run.json (a flock run) nor sweep.json (a flock sweep)")
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


def _assignments(client, run, tmp: Path) -> tuple[Optional[tuple], str]:
    """The run's (history, groups) from its ``assignments.npz`` artifact, else from its run
    directory; (None, why) when neither is there."""
    import numpy as np

    candidates = []
    try:
        if any(a.path == "assignments.npz" for a in client.list_artifacts(run.info.run_id)):
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


def load_run(client, run, tmp: Path) -> RunSummary:
    hist = {}
    for key in HISTORY_KEYS:
        if key in run.data.metrics:
            hist[key] = {int(m.step): float(m.value) for m in client.get_metric_history(run.info.run_id, key)}
    if "comm_bytes" not in hist and "bytes_total" in hist:  # runs from before comm_bytes: its running sum
        total, hist["comm_bytes"] = 0.0, {}
        for step in sorted(hist["bytes_total"]):
            total += hist["bytes_total"][step]
            hist["comm_bytes"][step] = total
    tags = run.data.tags
    name = run.info.run_name or tags.get("mlflow.runName") or run.info.run_id
    assignments, note = _assignments(client, run, tmp)
    return RunSummary(run_id=run.info.run_id, name=name, status=run.info.status, group=tags.get(COMBO_TAG) or name,
                      seed=tags.get(SEED_TAG) or run.data.params.get("seed"), final=dict(run.data.metrics),
                      history=hist, assignments=assignments, assignments_note=note, params=dict(run.data.params))


# ---------------------------------------------------------------------- tables


COLUMNS = (  # (key in RunSummary.final or a computed one, header, format)
    ("accuracy", "accuracy", "{:.4f}"),
    ("accuracy_p10", "p10", "{:.4f}"),
    ("accuracy_finetuned", "finetuned", "{:.4f}"),
    ("ari", "ARI", "{:.3f}"),
    ("num_clusters", "clusters", "{:.0f}"),
    ("comm_mb", "MB sent", "{:.2f}"),
    ("sim_time", "sim time (s)", "{:.1f}"),
    ("rounds", "rounds", "{:.0f}"),
)


def final_values(run: RunSummary) -> dict[str, Optional[float]]:
    f = run.final
    comm = f.get("comm_bytes")
    if comm is None and run.history.get("comm_bytes"):
        comm = run.history["comm_bytes"][max(run.history["comm_bytes"])]
    out = {k: f.get(k) for k, _, _ in COLUMNS}
    out.update(comm_mb=None if comm is None else comm / 1e6, rounds=run.rounds)
    return out


def _present(runs: list[RunSummary]) -> list[tuple[str, str, str]]:
    """The columns some run has a value for (accuracy_finetuned and ARI only where logged)."""
    vals = [final_values(r) for r in runs]
    return [c for c in COLUMNS if any(v[c[0]] is not None for v in vals)]


def _fmt(fmt: str, v: Optional[float]) -> str:
    return "" if v is None else fmt.format(v)


def run_table(runs: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    cols = _present(runs)
    grouped = any(r.group != r.name for r in runs)
    show_status = any(r.status != "FINISHED" for r in runs)
    algorithms = len({r.params.get("algorithm.name") for r in runs}) > 1  # a comparison of algorithms
    header = ["run", *(["combination"] if grouped else []), *(["algorithm"] if algorithms else []), "seed",
              *(["status"] if show_status else []), *[h for _, h, _ in cols]]
    rows = []
    for r in runs:
        v = final_values(r)
        rows.append([r.name, *([r.group] if grouped else []), *([r.params.get("algorithm.name", "")] if algorithms else []),
                     r.seed or "", *([r.status] if show_status else []), *[_fmt(f, v[k]) for k, _, f in cols]])
    return header, rows


def combinations(runs: list[RunSummary]) -> dict[str, list[RunSummary]]:
    """Sweep combinations with two or more runs (seeds), in first-seen order."""
    groups: dict[str, list[RunSummary]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return {g: rs for g, rs in groups.items() if len(rs) >= 2}


def combination_stats(runs: list[RunSummary]) -> list[dict[str, Any]]:
    """Per combination with ≥2 seeds: n and the mean and std (ddof=1) of every column."""
    import numpy as np

    cols = _present(runs)
    out = []
    for g, rs in combinations(runs).items():
        row: dict[str, Any] = {"combination": g, "seeds": len(rs)}
        for key, _, _ in cols:
            xs = np.array([v for v in (final_values(r)[key] for r in rs) if v is not None], float)
            row[f"{key}_mean"] = float(xs.mean()) if xs.size else None
            row[f"{key}_std"] = float(xs.std(ddof=1)) if xs.size >= 2 else (0.0 if xs.size else None)
        out.append(row)
    return out


def combination_table(runs: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    cols = _present(runs)
    header = ["combination", "seeds", *[h for _, h, _ in cols]]
    rows = []
    for s in combination_stats(runs):
        cells = [s["combination"], str(s["seeds"])]
        for key, _, f in cols:
            m, sd = s[f"{key}_mean"], s[f"{key}_std"]
            cells.append("" if m is None else f"{f.format(m)} ± {f.format(sd)}")
        rows.append(cells)
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csvs(runs: list[RunSummary], out: Path) -> list[Path]:
    import csv

    keys = [k for k, _, _ in COLUMNS]
    files = [out / "final_metrics.csv"]
    with open(files[0], "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run_id", "run_name", "combination", "algorithm", "seed", "status", *keys])
        for r in runs:
            v = final_values(r)
            w.writerow([r.run_id, r.name, r.group, r.params.get("algorithm.name", ""), r.seed or "", r.status,
                        *["" if v[k] is None else v[k] for k in keys]])
    stats = combination_stats(runs)
    if stats:
        files.append(out / "combination_metrics.csv")
        fields = list(stats[0])
        with open(files[1], "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            w.writeheader()
            w.writerows([{k: ("" if v is None else v) for k, v in s.items()} for s in stats])
    return files


# ---------------------------------------------------------------------- figures


def _series(runs: list[RunSummary], ykey: str, xkey: Optional[str]) -> list[dict]:
    """Lines for one figure: per sweep combination with ≥2 seeds the mean over its seeds (with
    a ±std band) at the steps they all logged; every other run as its own line. ``xkey`` None:
    x is the round; else x is that metric's value at the same round."""
    import numpy as np

    groups: dict[str, list[RunSummary]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    out = []
    for g, rs in groups.items():
        rs = [r for r in rs if r.history.get(ykey) and (xkey is None or r.history.get(xkey))]
        if not rs:
            continue
        steps = sorted(set.intersection(*[set(r.history[ykey]) & (set(r.history[xkey]) if xkey else set(r.history[ykey]))
                                          for r in rs]))
        if not steps:
            continue
        y = np.array([[r.history[ykey][s] for s in steps] for r in rs])
        x = np.array([[r.history[xkey][s] if xkey else s for s in steps] for r in rs], float)
        label = g if len(rs) == 1 else f"{g} (mean ± std, {len(rs)} seeds)"
        out.append({"label": label, "x": x.mean(0), "y": y.mean(0), "std": y.std(0, ddof=1) if len(rs) > 1 else None})
    return out


def draw_figures(runs: list[RunSummary], out: Path) -> dict[str, Any]:
    """Writes the figures; returns {figure name: path or a note saying why it is missing}."""
    from flockfl import plots

    metric = "accuracy" if any(r.history.get("accuracy") for r in runs) else "loss"
    made: dict[str, Any] = {}
    acc = _series(runs, metric, None)
    if acc:
        made["accuracy_per_round.png"] = plots.line_panels(
            [{"title": f"{metric} per round", "xlabel": "round", "ylabel": metric, "series": acc}],
            out / "accuracy_per_round.png")
    else:
        made["accuracy_per_round.png"] = f"no run logged {metric} per round"
    ari = _series(runs, "ari", None)
    if ari:
        made["ari_per_round.png"] = plots.line_panels(
            [{"title": "clustering ARI against the true groups", "xlabel": "round", "ylabel": "ARI", "series": ari}],
            out / "ari_per_round.png")
    else:
        made["ari_per_round.png"] = ("no run logged ARI (it needs a clustered algorithm and a partition "
                                     "with true groups)")
    with_maps = [r for r in runs if r.assignments is not None][:MAX_HEATMAP_PANELS]
    if with_maps:
        made["cluster_assignments.png"] = plots.assignment_panels(
            [(r.name, *r.assignments) for r in with_maps], out / "cluster_assignments.png")
    else:
        made["cluster_assignments.png"] = "no run has an assignments.npz (artifact or run directory)"
    for fname, xkey, xlabel, scale in (("accuracy_vs_comm.png", "comm_bytes", "MB communicated (cumulative)", 1e-6),
                                       ("accuracy_vs_sim_time.png", "sim_time", "simulated time (s)", 1.0)):
        series = _series(runs, metric, xkey)
        for s in series:
            s["x"] = s["x"] * scale
        if series:
            made[fname] = plots.line_panels(
                [{"title": f"{metric} against {xlabel.split(' (')[0]}", "xlabel": xlabel, "ylabel": metric,
                  "series": series}], out / fname)
        else:
            made[fname] = f"no run logged {xkey}"
    return made


# ---------------------------------------------------------------------- documents


def _sections(title: str, meta: list[tuple[str, str]], runs: list[RunSummary], figures: dict[str, Any]) -> list[tuple]:
    """The report as (kind, payload) blocks, rendered to markdown and to HTML alike."""
    blocks: list[tuple] = [("h1", title), ("meta", meta), ("h2", "Final metrics"), ("table", run_table(runs))]
    if combinations(runs):
        blocks += [("h2", "Per combination (mean ± std over seeds)"), ("table", combination_table(runs))]
    metric = "accuracy" if any(r.history.get("accuracy") for r in runs) else "loss"
    for heading, fname in ((f"{metric.capitalize()} per round", "accuracy_per_round.png"),
                           ("ARI per round", "ari_per_round.png"),
                           ("Cluster assignments (clients sorted by true group × rounds)", "cluster_assignments.png"),
                           (f"{metric.capitalize()} against communicated bytes", "accuracy_vs_comm.png"),
                           (f"{metric.capitalize()} against simulated time", "accuracy_vs_sim_time.png")):
        blocks.append(("h2", heading))
        fig = figures.get(fname)
        blocks.append(("img", fname) if isinstance(fig, Path) else ("note", str(fig)))
        if fname == "cluster_assignments.png":
            missing = [f"{r.name}: {r.assignments_note}" for r in runs if r.assignments is None]
            drawn = sum(r.assignments is not None for r in runs)
            if drawn > MAX_HEATMAP_PANELS:
                missing.append(f"only the first {MAX_HEATMAP_PANELS} of {drawn} runs are drawn")
            if missing and isinstance(fig, Path):
                blocks.append(("note", "Not drawn: " + "; ".join(missing)))
    return blocks


def render_markdown(blocks: list[tuple]) -> str:
    parts = []
    for kind, payload in blocks:
        if kind == "h1":
            parts.append(f"# {payload}")
        elif kind == "h2":
            parts.append(f"## {payload}")
        elif kind == "meta":
            parts.append("\n".join(f"- **{k}**: {v}" for k, v in payload))
        elif kind == "table":
            parts.append(markdown_table(*payload))
        elif kind == "img":
            parts.append(f"![{payload}]({payload})")
        elif kind == "note":
            parts.append(f"_{payload}_")
    return "\n\n".join(parts) + "\n"


HTML_STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;height:auto}
.note{color:#666;font-style:italic}ul.meta{list-style:none;padding:0;color:#444}.scroll{overflow-x:auto}"""


def render_html(blocks: list[tuple], out: Path) -> str:
    """One self-contained page: the tables as HTML tables, every PNG inlined as a data URI."""
    import base64
    from html import escape

    title = next((p for k, p in blocks if k == "h1"), "flock report")
    body = []
    for kind, payload in blocks:
        if kind == "h1":
            body.append(f"<h1>{escape(payload)}</h1>")
        elif kind == "h2":
            body.append(f"<h2>{escape(payload)}</h2>")
        elif kind == "meta":
            body.append('<ul class="meta">' + "".join(f"<li><b>{escape(k)}</b>: {escape(str(v))}</li>" for k, v in payload)
                        + "</ul>")
        elif kind == "table":
            header, rows = payload
            body.append('<div class="scroll"><table><thead><tr>' + "".join(f"<th>{escape(h)}</th>" for h in header)
                        + "</tr></thead><tbody>"
                        + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
                        + "</tbody></table></div>")
        elif kind == "img":
            data = base64.b64encode((out / payload).read_bytes()).decode()
            body.append(f'<p><img alt="{escape(payload)}" src="data:image/png;base64,{data}"></p>')
        elif kind == "note":
            body.append(f'<p class="note">{escape(payload)}</p>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{HTML_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


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
    title = f"flock report: {name} ({root.info.run_id})"
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
    with tempfile.TemporaryDirectory(prefix="flock-report-") as tmp:
        runs = [load_run(client, r, Path(tmp)) for r in (children or [root])]
    out = Path(args.out or f"runs/reports/{_safe(name)}-{run_id[:8]}")
    report = build_report(client, root, runs, out, uri, args.html)

    print(f"{report['title']}\n\nFinal metrics\n")
    print(markdown_table(*run_table(runs)))
    if combinations(runs):
        print("\nPer combination (mean ± std over seeds)\n")
        print(markdown_table(*combination_table(runs)))
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
            print(f"flock: warning: the report could not be logged to MLflow run {run_id}: {msg}", file=sys.stderr)
            return 0
        where = "report.html" if args.html else "report.md"
        print(f"logged to MLflow run {name} ({run_id}): {root.info.artifact_uri.rstrip('/')}/report")
        print(f"browse it: flock ui --tracking-uri {uri}, then open "
              f"http://127.0.0.1:5000/#/experiments/{root.info.experiment_id}/runs/{run_id}/artifacts/report/{where}")
    return 0
