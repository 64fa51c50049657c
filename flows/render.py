"""What ``flockfl report`` and ``flockfl sweep`` print and write: the tables (final metrics per
run, mean ± std per combination, the thresholds and cluster counts ``algorithm.*=auto`` chose),
the figures (accuracy and ARI per round, assignment heat-maps, accuracy against bytes and
simulated time, the auto criterion's curves) and the Markdown and HTML documents."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

MAX_HEATMAP_PANELS = 48
AUTO_HEADING = "Thresholds and cluster counts chosen from the data (auto)"
AUTO_FIGURE = "auto_choice_curves.png"
# what every auto decision record holds (flockfl.clustering.choose.Choice.record); the rest are a
# method's own extras (CFL's cluster, members and confirmed, IFCA's embedding), shown beside the reason
AUTO_FIELDS = ("key", "algorithm", "round", "criterion", "floor", "nested", "k", "value", "score", "margin", "clients",
               "reason", "curve", "unit")


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
    auto_choices: list[dict] = field(default_factory=list)  # auto_choices.json's decisions, oldest first
    auto_note: str = ""  # why a run with an algorithm.*=auto key has none

    @property
    def rounds(self) -> Optional[int]:
        if "round" in self.final:
            return int(self.final["round"])
        steps = [s for k in ("accuracy", "loss") for s in self.history.get(k, {})]
        return max(steps) if steps else None


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


def auto_latest(run: RunSummary) -> list[tuple[dict, int]]:
    """(latest decision, number of decisions) per auto key of the run, in first-decided order:
    a per-round decider (FLIS-DC, FedAC, CFL's split tests) decides many times, and its latest
    decision is the one the run ended with."""
    latest: dict[str, dict] = {}
    count: dict[str, int] = {}
    for rec in run.auto_choices:
        latest[rec["key"]] = rec
        count[rec["key"]] = count.get(rec["key"], 0) + 1
    return [(latest[k], count[k]) for k in latest]


def _decided(rec: dict) -> str:
    return "before round 0" if rec["round"] < 0 else f"round {rec['round']}"


def _auto_value(rec: dict) -> str:
    """The chosen threshold in the method's units ("" where none applies: k-means methods, or
    one cluster cut above every merge)."""
    if rec.get("value") is None:
        return ""
    return f"{rec['value']:.4g}" + (f" {rec['unit']}" if rec.get("unit") else "")


def _auto_why(rec: dict) -> str:
    extras = ", ".join(f"{k}={v}" for k, v in rec.items() if k not in AUTO_FIELDS)
    return "; ".join(p for p in (rec.get("reason", ""), extras) if p)


def auto_table(runs: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """One row per (run, auto key): its latest decision (where, the chosen k and value, the
    criterion's score and margin), how many decisions the run made for that key, and why."""
    header = ["run", "algorithm", "key", "decided", "chosen k", "value", "score", "margin", "decisions", "why"]
    rows = []
    for r in runs:
        for rec, n in auto_latest(r):
            rows.append([r.name, rec.get("algorithm", ""), rec["key"], _decided(rec), str(rec["k"]), _auto_value(rec),
                         _fmt("{:.3f}", rec.get("score")), _fmt("{:.3f}", rec.get("margin")), str(n), _auto_why(rec)])
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
    if any(r.auto_choices for r in runs):  # every decision, not only the latest: how a per-round choice moved
        import json

        files.append(out / "auto_choices.csv")
        with open(files[-1], "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["run_id", "run_name", "combination", "algorithm", "key", "round", "k", "value", "unit", "score",
                        "margin", "clients", "criterion", "floor", "nested", "reason", "extras"])
            for r in runs:
                for rec in r.auto_choices:
                    w.writerow([r.run_id, r.name, r.group, *["" if rec.get(k) is None else rec[k] for k in (
                        "algorithm", "key", "round", "k", "value", "unit", "score", "margin", "clients", "criterion",
                        "floor", "nested", "reason")],
                        json.dumps({k: v for k, v in rec.items() if k not in AUTO_FIELDS}, sort_keys=True)])
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


def auto_curves(panels: list[tuple[str, dict, int]], path: Path, ncols: int = 3) -> Path:
    """One panel per (title, latest auto decision, number of decisions): the criterion's curve
    (mean silhouette per candidate k), the worst cluster's own best split where the nested test
    looked, the one-cluster floor, the nested threshold and the chosen k. The panels share one
    silhouette scale, so how clear each run's choice was compares at a glance."""
    import textwrap

    from matplotlib.ticker import MaxNLocator

    from flockfl.plots import auto_curve, plt

    ncols = max(1, min(ncols, len(panels)))
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 4.0 * nrows), squeeze=False, sharey=True,
                             layout="constrained")
    for i, (ax, (title, rec, n)) in enumerate(zip(axes.flat, panels)):
        ks = auto_curve(ax, rec)
        if not ks:
            ax.text(0.5, 0.5, textwrap.fill(f"no candidates: {rec.get('reason', '')}", 40), transform=ax.transAxes,
                    ha="center", va="center", fontsize=8)
        ax.set_xlim(left=0.5, right=max([rec["k"], *ks]) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        margin = "n/a" if rec.get("margin") is None else f"{rec['margin']:.3f}"
        latest = "" if n == 1 else f" (latest of {n})"
        ax.set_title(f"{textwrap.fill(title, 52)}\n{rec.get('algorithm', '')} {rec['key']}=auto, {_decided(rec)}"
                     f"{latest}: k = {rec['k']}, margin {margin}", fontsize=8)
        if i % ncols == 0:
            ax.set_ylabel(rec.get("criterion", "silhouette"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


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
    panels = [(r.name, rec, n) for r in runs for rec, n in auto_latest(r)]
    if panels:  # no auto key anywhere: no figure and no section
        made[AUTO_FIGURE] = auto_curves(panels[:MAX_HEATMAP_PANELS], out / AUTO_FIGURE)
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
            blocks += _auto_section(runs, figures)
    return blocks


def _auto_section(runs: list[RunSummary], figures: dict[str, Any]) -> list[tuple]:
    """The evidence behind ``algorithm.*=auto``: the latest decision per run and key, and the
    criterion's curves side by side; nothing when no run has an auto key."""
    missing = [f"{r.name}: {r.auto_note}" for r in runs if r.auto_note]
    panels = [rec for r in runs for rec, _ in auto_latest(r)]
    if not panels and not missing:
        return []
    blocks: list[tuple] = [("h2", AUTO_HEADING)]
    if panels:
        floors = sorted({rec["floor"] for rec in panels})
        nested = sorted({rec["nested"] for rec in panels if rec.get("nested") is not None})
        blocks.append(("note", "Each method scored the partitions it would make at each number of clusters k by the "
                               "mean silhouette on its own distances and took the best (ties: the fewer clusters); a "
                               f"best score ≤ {', '.join(map(str, floors))} means no substantial structure, so one "
                               "cluster" + (f", and a group already found is split again only above "
                                            f"{', '.join(map(str, nested))}" if nested else "")
                               + ". The margin is how clear the choice was, in silhouette units. One row per run and "
                                 "key: its latest decision."))
        blocks.append(("table", auto_table(runs)))
        if isinstance(figures.get(AUTO_FIGURE), Path):
            blocks.append(("img", AUTO_FIGURE))
            if len(panels) > MAX_HEATMAP_PANELS:
                blocks.append(("note", f"Not drawn: only the first {MAX_HEATMAP_PANELS} of {len(panels)} curves"))
    if missing:
        blocks.append(("note", "No auto evidence: " + "; ".join(missing)))
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

    title = next((p for k, p in blocks if k == "h1"), "flockfl report")
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
