"""The figures of ``flockfl report`` (:func:`draw_figures`): accuracy and ARI per round, the
cluster assignment heat-maps, accuracy against communicated bytes and simulated time (per
sweep combination the mean ± std over its seeds, :func:`_series`) and the auto criterion's
curves (:func:`auto_curves`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from flows.render import AUTO_FIGURE, MAX_HEATMAP_PANELS, RunSummary, auto_latest, decided


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
        ax.set_title(f"{textwrap.fill(title, 52)}\n{rec.get('algorithm', '')} {rec['key']}=auto, {decided(rec)}"
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
