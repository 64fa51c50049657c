"""Figures logged with every run (accuracy curves, the cluster-assignment heat-map, client ×
client matrices) and the ones `flockfl report` draws across runs.

Colours that stand for k things (clusters, runs, sweep combinations) come from
:func:`discrete_colors`: exactly k distinct colours, so a k=4 heat-map shows four."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import BoundaryNorm, ListedColormap, to_rgba  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

UNASSIGNED_COLOR = "#e6e6e6"  # light grey for cluster id -1 (the client was not assigned yet)


def discrete_colors(k: int) -> list[tuple]:
    """k distinct RGBA colours: tab10 up to 10, tab20 up to 20 (its ten strong hues first, then
    their light partners), otherwise ``turbo`` sampled at k evenly spaced points."""
    k = max(int(k), 0)
    if k <= 10:
        return [tuple(c) for c in plt.get_cmap("tab10").colors[:k]]
    if k <= 20:
        tab20 = plt.get_cmap("tab20").colors
        return [to_rgba(c) for c in (tab20[0::2] + tab20[1::2])[:k]]
    return [tuple(c) for c in plt.get_cmap("turbo")(np.linspace(0.0, 1.0, k))]


def cluster_colormap(k: int, unassigned: bool = False) -> tuple[ListedColormap, BoundaryNorm, list[int], list[str]]:
    """A colormap with one colour per cluster id 0..k-1 (plus light grey for -1 when
    ``unassigned``), the ``BoundaryNorm`` that maps each integer to its own colour, and the
    colorbar's ticks and labels (every id up to 20 clusters, thinned beyond; "none" for -1)."""
    k = max(int(k), 0 if unassigned else 1)
    colors = ([to_rgba(UNASSIGNED_COLOR)] if unassigned else []) + discrete_colors(k)
    lo = -1 if unassigned else 0
    cmap = ListedColormap(colors, name=f"clusters{k}{'+none' if unassigned else ''}")
    norm = BoundaryNorm(np.arange(lo, k + 1) - 0.5, ncolors=cmap.N)
    every = max(1, int(np.ceil(k / 20)))
    ticks = ([-1] if unassigned else []) + list(range(0, k, every))
    return cmap, norm, ticks, ["none" if t < 0 else str(t) for t in ticks]


def _assignment_scale(histories: list[np.ndarray]) -> tuple[ListedColormap, BoundaryNorm, list[int], list[str]]:
    """The shared colour scale of one or more assignment histories: k = largest id + 1."""
    ids = np.concatenate([np.asarray(h).ravel() for h in histories]) if histories else np.zeros(0, int)
    k = int(ids.max()) + 1 if ids.size else 1
    return cluster_colormap(k, unassigned=bool((ids < 0).any()))


def _draw_assignments(ax, history: np.ndarray, groups: np.ndarray, cmap, norm):
    """Clients (rows, sorted by true group when every group is known) × rounds (columns);
    thin white lines separate the true groups."""
    history = np.asarray(history)
    groups = np.asarray(groups)
    n = history.shape[1] if history.ndim == 2 else 0
    known = len(groups) >= n > 0 and (groups[:n] >= 0).all()
    order = np.argsort(groups[:n], kind="stable") if known else np.arange(n)
    rounds = history.shape[0] if history.ndim == 2 else 0
    im = ax.imshow(history[:, order].T if n else np.zeros((0, rounds)), aspect="auto", interpolation="nearest",
                   cmap=cmap, norm=norm, extent=(0.5, rounds + 0.5, n - 0.5, -0.5))
    if known:
        for b in np.flatnonzero(np.diff(groups[:n][order])) + 0.5:
            ax.axhline(b, color="white", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("client (sorted by true group)" if known else "client")
    return im


def accuracy_curves(history: list[dict], path: Path) -> Path:
    history = [h for h in history if "loss" in h]  # evaluated rounds only
    rounds = [h["round"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    key = "accuracy" if any("accuracy" in h for h in history) else "loss"
    for name, style in ((key, "-"), (f"{key}_p10", "--"), (f"{key}_min", ":")):
        if any(name in h for h in history):
            ax.plot(rounds, [h.get(name, np.nan) for h in history], style, color="black", label=name)
    clusters = sorted({k for h in history for k in h if k.startswith("cluster/") and k.endswith(f"/{key}")},
                      key=lambda c: int(c.split("/")[1]) if c.split("/")[1].isdigit() else 0)
    if len(clusters) <= 10:  # one line per cluster stays readable up to 10, in its heat-map colour
        ids = [int(c.split("/")[1]) if c.split("/")[1].isdigit() else 0 for c in clusters]
        colors = discrete_colors(max(ids, default=-1) + 1)
        for j, c in zip(ids, clusters):
            ax.plot(rounds, [h.get(c, np.nan) for h in history], alpha=0.7, lw=1, color=colors[j], label=c)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def assignment_heatmap(history: np.ndarray, groups: np.ndarray, path: Path) -> Path:
    """Clients (sorted by true group) × rounds, coloured by assigned cluster: k colours for k
    clusters, light grey for "not assigned" (-1)."""
    cmap, norm, ticks, labels = _assignment_scale([history])
    fig, ax = plt.subplots(figsize=(6, 4))
    im = _draw_assignments(ax, history, groups, cmap, norm)
    cbar = fig.colorbar(im, ax=ax, label="assigned cluster", ticks=ticks)
    cbar.ax.set_yticklabels(labels)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def assignment_panels(panels: list[tuple[str, np.ndarray, np.ndarray]], path: Path, ncols: int = 3) -> Path:
    """One assignment heat-map per (title, history, groups), on one shared k-colour scale
    (k = the largest cluster id of any panel + 1) with one colorbar."""
    cmap, norm, ticks, labels = _assignment_scale([h for _, h, _ in panels])
    ncols = max(1, min(ncols, len(panels)))
    nrows = max(1, -(-len(panels) // ncols))
    # constrained layout keeps each two-line title clear of the axis labels of the row above
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.2, 3.6 * nrows), squeeze=False,
                             layout="constrained")
    im = None
    for ax, (title, history, groups) in zip(axes.flat, panels):
        im = _draw_assignments(ax, history, groups, cmap, norm)
        h = np.asarray(history)
        ax.set_title(f"{title}\n(k={int(h.max()) + 1 if h.size else 0})", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if im is not None:
        cbar = fig.colorbar(im, ax=axes.ravel().tolist(), label="assigned cluster", ticks=ticks)
        cbar.ax.set_yticklabels(labels)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def line_panels(panels: list[dict], path: Path, panel_size: tuple[float, float] = (6.0, 4.0)) -> Path:
    """Side-by-side line plots. Each panel: ``title``, ``xlabel``, ``ylabel``, optional
    ``xscale`` and ``series``, a list of ``{"label", "x", "y"}`` with optional ``"std"`` (drawn
    as a ±std band). The i-th series of every panel gets the i-th of ``discrete_colors(n)``, so
    a run (or sweep combination) has the same colour in every figure."""
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    n = max((len(p["series"]) for p in panels), default=0)
    colors = discrete_colors(n)
    for ax, panel in zip(axes.flat, panels):
        for color, s in zip(colors, panel["series"]):
            x, y = np.asarray(s["x"], float), np.asarray(s["y"], float)
            if not x.size:
                continue
            ax.plot(x, y, "-", marker="o" if x.size <= 30 else None, ms=3, lw=1.5, color=color, label=s["label"])
            if s.get("std") is not None:
                std = np.asarray(s["std"], float)
                ax.fill_between(x, y - std, y + std, color=color, alpha=0.2, lw=0)
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("xscale"):
            ax.set_xscale(panel["xscale"])
        if panel["xlabel"] == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if n:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        if n <= 8:
            axes.flat[0].legend(fontsize=7)
        else:
            fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5),
                       ncol=1 + n // 30)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def matrix_heatmap(matrix: np.ndarray, groups: np.ndarray, title: str, path: Path) -> Path:
    """A client × client matrix (PACFL's proximity, FLIS's similarity), clients sorted by true group."""
    n = matrix.shape[0]
    order = np.argsort(groups[:n], kind="stable") if len(groups) >= n and (groups[:n] >= 0).all() else np.arange(n)
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(matrix[np.ix_(order, order)], interpolation="nearest", cmap="viridis")
    ax.set_title(title)
    ax.set_xlabel("client (sorted by true group)" if order is not None else "client")
    ax.set_ylabel("client")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def auto_curve(ax, rec: dict) -> list[int]:
    """One ``auto`` decision's evidence on ``ax``: the criterion's curve (mean silhouette per
    candidate k), the worst cluster's own best split where the nested test looked, the
    one-cluster floor, the nested threshold and the chosen k (a star on the curve where it is a
    candidate). Returns the candidates' k."""
    curve = rec.get("curve") or []
    ks = [c["k"] for c in curve]
    scores = [np.nan if c.get("score") is None else c["score"] for c in curve]
    ax.plot(ks, scores, "o-", ms=4, color="tab:blue", label=f"mean {rec.get('criterion', 'silhouette')}")
    tested = [(c["k"], c["worst_cluster"]) for c in curve if c.get("worst_cluster") is not None]
    if tested:
        ax.plot(*zip(*tested), "s", color="tab:orange", label="worst cluster's own best split")
    ax.axhline(rec["floor"], color="grey", ls="--", lw=1, label=f"no structure ≤ {rec['floor']}")
    if rec.get("nested") is not None:
        ax.axhline(rec["nested"], color="grey", ls=":", lw=1, label=f"split a group again > {rec['nested']}")
    ax.axvline(rec["k"], color="tab:green", lw=1.5, label=f"chosen k = {rec['k']}")
    chosen = scores[ks.index(rec["k"])] if rec["k"] in ks else np.nan  # one cluster: not a candidate
    if np.isfinite(chosen):
        ax.plot([rec["k"]], [chosen], "*", ms=13, color="tab:green")
    ax.set_xlabel("clusters k")
    return ks


def auto_choice(records: list[dict], path: Path) -> Path:
    """The evidence of ``auto`` decisions (``state.meta['auto_choices']``): for the latest
    decision of each key, the criterion's curve over the candidates (mean silhouette per k, the
    worst cluster's own best split where it was tested, the floors, the chosen k); where a
    method decides again each round, a second panel with the chosen k over the rounds."""
    latest: dict[str, dict] = {}
    for r in records:
        latest[r["key"]] = r
    rounds = [r for r in records if r["round"] >= 0]
    panels = len(latest) + (1 if len(rounds) > 1 else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.0), squeeze=False)
    for ax, (key, r) in zip(axes[0], latest.items()):
        auto_curve(ax, r)
        where = "before round 0" if r["round"] < 0 else f"round {r['round']}"
        value = "" if r["value"] is None else f", {key.split('.')[-1]} = {r['value']:.4g}"
        margin = "n/a" if r["margin"] is None else f"{r['margin']:.3f}"
        ax.set_title(f"{r['algorithm']} {key}=auto, {where}{value}\nmargin {margin}", fontsize=9)
        ax.set_ylabel("silhouette")
        ax.legend(fontsize=7)
    if len(rounds) > 1:
        ax = axes[0][-1]
        for key in latest:
            rs = [r for r in rounds if r["key"] == key]
            ax.step([r["round"] for r in rs], [r["k"] for r in rs], where="post", label=key)
        ax.set_xlabel("round")
        ax.set_ylabel("chosen k")
        ax.set_title("decisions over the rounds", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
