"""A sweep's table: per grid combination, the seeds that finished and the mean ± std of each
column (:func:`aggregate`), and the Markdown table ``flockfl sweep`` prints and logs to the
MLflow parent run (:func:`sweep_table`)."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flows.sweep_plan import Child, Plan

# (header, summary metric, format): the sweep table's columns, shown when any run has them
COLUMNS = [
    ("accuracy", "accuracy", ".3f"), ("p10", "accuracy_p10", ".3f"), ("after local training", "accuracy_finetuned", ".3f"),
    ("ARI", "ari", ".3f"), ("clusters", "num_clusters", ".1f"), ("MB sent", "mb_total", ".1f"),
    ("wall s", "wall_s", ".1f"),
]


def _values(child: Child) -> dict[str, float]:
    s = child.summary or {}
    m = dict(s.get("metrics") or {})
    m["mb_total"] = (s.get("bytes_total") or 0) / 1e6
    m["wall_s"] = s.get("wall_s")
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def aggregate(plan: Plan) -> dict[str, dict]:
    """Per combination: the seeds that finished and mean/std (sample std, ddof=1) of each column."""
    out: dict[str, dict] = {}
    for label in dict.fromkeys(c.label for c in plan.children):
        done = [c for c in plan.children if c.label == label and c.status == "finished"]
        vals = [_values(c) for c in done]
        row = {}
        for _, key, _ in COLUMNS:
            xs = [v[key] for v in vals if key in v and math.isfinite(v[key])]
            row[key] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                        "std": statistics.stdev(xs) if len(xs) > 1 else float("nan"), "n": len(xs)}
        out[label] = {"seeds": [c.seed for c in done], "metrics": row,
                      "failed": [c.seed for c in plan.children if c.label == label and c.status == "failed"]}
    return out


def sweep_table(plan: Plan) -> str:
    """Markdown: one row per combination, mean ± std over its seeds (columns any run has)."""
    from flows.render import markdown_table

    agg = aggregate(plan)
    cols = [c for c in COLUMNS if any(row["metrics"][c[1]]["n"] for row in agg.values())]
    rows = []
    for label, row in agg.items():
        cells = [label, f"{len(row['seeds'])}/{len(row['seeds']) + len(row['failed'])}"
                 if row["failed"] else str(len(row["seeds"]))]
        for _, key, fmt in cols:
            v = row["metrics"][key]
            if not v["n"]:
                cells.append("–")
            elif v["n"] == 1:
                cells.append(format(v["mean"], fmt))
            else:
                cells.append(f"{format(v['mean'], fmt)} ± {format(v['std'], fmt)}")
        rows.append(cells)
    return markdown_table(["combination", "seeds"] + [h for h, _, _ in cols], rows)

