"""What ``flockfl repro`` prints and writes of a table's results: each cell's values under each
convention (:func:`cell_values`, read from the runs' summaries by :func:`summary_metrics` and
:func:`first_metric`), the table beside the published numbers with the within-tolerance counts
(:func:`render`, Markdown and JSON) and the paragraph naming the setting every cell ran with
(:func:`describe_setting`)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

from flows.repro_plan import ReproPlan
from flows.repro_tables import cell_label, compared, has_cell


def cell_values(plan: ReproPlan) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per cell, per convention label: the finished seeds' values (scaled, e.g. to percent)."""
    t = plan.table
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in plan.rows:
        for c in plan.cols:
            if not has_cell(t, r, c):
                continue
            label = cell_label(r, c)
            done = [ch for ch in plan.sweep.children if ch.label == label and ch.status == "finished" and ch.summary]
            vals = {}
            for conv in t.conventions:
                xs = [first_metric(summary_metrics(ch.summary), conv["metric"]) for ch in done]
                vals[conv["label"]] = [t.scale * float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
            out[(r, c)] = vals
    return out


def summary_metrics(summary: dict) -> dict:
    """A run's metrics, with every convention's ``accuracy`` under the run's report mode added
    by its logged name: ``summarise`` reports ``accuracy__label_union__clients__best`` for each
    mode; a column names ``accuracy__label_union__clients``, read under the run's own mode."""
    metrics = dict(summary.get("metrics") or {})
    mode = (summary.get("protocol") or {}).get("report")
    for key, value in list(metrics.items()):
        name, _, got = key.rpartition("__")
        if key.count("__") == 3 and got == mode:
            metrics.setdefault(name, value)
    return metrics


def first_metric(metrics: dict, keys) -> Optional[float]:
    """The first of ``keys`` (one name or a list) that the run reported."""
    for key in [keys] if isinstance(keys, str) else keys:
        if metrics.get(key) is not None:
            return metrics[key]
    return None


def _ms(xs: list[float]) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def _published(v: Any) -> Optional[float]:
    if v is None:
        return None
    return float(v[0]) if isinstance(v, (list, tuple)) else float(v)


def _pub_text(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, (list, tuple)):
        return f"{float(v[0]):.2f} ± {float(v[1]):.2f}" if len(v) > 1 and v[1] is not None else f"{float(v[0]):.2f}"
    return f"{float(v):.2f}"


def render(plan: ReproPlan) -> tuple[str, dict]:
    """The table as markdown (one row per method; per column, ours under each convention and each
    published source) and as JSON, with the within-tolerance counts against each source."""
    from flows.render import markdown_table

    t = plan.table
    vals = cell_values(plan)
    header = ["method"]
    for c in plan.cols:
        for conv in t.conventions:
            header.append(f"{c + ' ' if c else ''}ours: {conv['label']}")
        for source in t.published:
            header.append(f"{c + ' ' if c else ''}{source}")
    lines, cells_json = [], []
    star = len(t.conventions) > 1 and bool(t.published)  # mark the compared value where there is a choice
    hits = {s: [0, 0] for s in t.tolerance}
    for r in plan.rows:
        line = [r]
        for c in plan.cols:
            if not has_cell(t, r, c):
                line += ["·"] * (len(t.conventions) + len(t.published))
                continue
            v, first = vals[(r, c)], compared(t, r)
            line += [_ms(v[conv["label"]]) + ("*" if star and conv["label"] == first and v[first] else "")
                     for conv in t.conventions]
            cell = {"row": r, "column": c, "ours": {k: {"values": xs, "mean": statistics.fmean(xs) if xs else None}
                                                     for k, xs in v.items()}, "published": {}, "compared": first}
            for source, by_row in t.published.items():
                pub = (by_row.get(r) or {}).get(c)
                line.append(_pub_text(pub))
                cell["published"][source] = pub
                p, xs = _published(pub), v[first]
                if source in hits and p is not None and xs:
                    hits[source][1] += 1
                    hits[source][0] += abs(statistics.fmean(xs) - p) <= float(t.tolerance[source])
            cells_json.append(cell)
        lines.append(line)
    text = markdown_table(header, lines)
    if star:
        text += ("\n\n`*`: the convention compared with the published numbers (the first, or the row's own where its "
                 "paper's code measured that method another way)")
    within = {s: {"within": h[0], "of": h[1], "points": float(t.tolerance[s])} for s, h in hits.items()}
    return text, {"cells": cells_json, "within_tolerance": within}


def describe_setting(plan: ReproPlan) -> str:
    """One paragraph naming the data, model, budget and protocol every cell ran with."""
    from flockfl.config import deep_merge

    cfg = plan.sweep.base
    tr, ev = cfg.train, cfg.eval
    paper = deep_merge(plan.table.base, plan.table.budgets.get("paper", {})).get("train", {})
    ran = deep_merge(tr.model_dump(), plan.table.budgets[plan.budget].get("train", {}))  # the cells' budget
    tr = tr.model_copy(update={k: ran[k] for k in ("rounds", "local_epochs", "clients_per_round")})
    return (f"{cfg.dataset.name}, {cfg.partition.num_clients} clients, {tr.clients_per_round} per round, "
            f"{cfg.model.name}; {tr.rounds} rounds × {tr.local_epochs} local epochs (budget '{plan.budget}'; the "
            f"paper's: {paper.get('rounds', '?')} × {paper.get('local_epochs', '?')}), batch {tr.batch_size}, lr {tr.lr}, "
            f"momentum {tr.momentum}, weight decay {tr.weight_decay}; protocol: test_set={ev.test_set}, "
            f"average={ev.average}, report={ev.report}" + (f" (last_k={ev.last_k})" if ev.report == "mean_last" else "")
            + f"; seeds {' '.join(map(str, plan.sweep.seeds))}"
            + (f"; applied to every cell: {' '.join(plan.overrides)}" if plan.overrides else ""))
