"""The documents of ``flockfl report``: the report as (kind, payload) blocks (:func:`_sections`,
with the ``algorithm.*=auto`` evidence from :func:`_auto_section`), rendered to Markdown
(:func:`render_markdown`) and to one self-contained HTML page (:func:`render_html`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.render import (AUTO_FIGURE, AUTO_HEADING, MAX_HEATMAP_PANELS, RunSummary, auto_latest, auto_table,
                          combination_table, combinations, markdown_table, run_table)


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
