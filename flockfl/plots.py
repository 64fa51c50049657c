"""Figures logged with every run: accuracy curves and the cluster-assignment heat-map."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def accuracy_curves(history: list[dict], path: Path) -> Path:
    history = [h for h in history if "loss" in h]  # evaluated rounds only
    rounds = [h["round"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    key = "accuracy" if any("accuracy" in h for h in history) else "loss"
    for name, style in ((key, "-"), (f"{key}_p10", "--"), (f"{key}_min", ":")):
        if any(name in h for h in history):
            ax.plot(rounds, [h.get(name, np.nan) for h in history], style, label=name)
    clusters = sorted({k for h in history for k in h if k.startswith("cluster/") and k.endswith(f"/{key}")})
    for c in clusters if len(clusters) <= 10 else []:  # one line per cluster stays readable up to 10
        ax.plot(rounds, [h.get(c, np.nan) for h in history], alpha=0.5, lw=1, label=c)
    ax.set_xlabel("round")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def assignment_heatmap(history: np.ndarray, groups: np.ndarray, path: Path) -> Path:
    """Clients (sorted by true group) × rounds, coloured by assigned cluster."""
    order = np.argsort(groups, kind="stable") if (groups >= 0).all() else np.arange(history.shape[1])
    fig, ax = plt.subplots(figsize=(6, 4))
    im = ax.imshow(history[:, order].T, aspect="auto", interpolation="nearest", cmap="tab10",
                   vmin=0, vmax=max(9, int(history.max()) if history.size else 9))
    ax.set_xlabel("round")
    ax.set_ylabel("client (sorted by true group)" if (groups >= 0).all() else "client")
    fig.colorbar(im, ax=ax, label="assigned cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
