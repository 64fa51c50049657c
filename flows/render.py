"""What ``flockfl report`` and ``flockfl sweep`` print and write, here the runs as the report sees
them (:class:`RunSummary`) and the tables: final metrics per run, mean ± std per combination,
the thresholds and cluster counts ``algorithm.*=auto`` chose, as Markdown and CSV. The figures
(accuracy and ARI per round, assignment heat-maps, accuracy against bytes and simulated time,
the auto criterion's curves): flows/render_figures.py; the Markdown and HTML documents:
flows/render_documents.py."""

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


def decided(rec: dict) -> str:
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
            rows.append([r.name, rec.get("algorithm", ""), rec["key"], decided(rec), str(rec["k"]), _auto_value(rec),
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
