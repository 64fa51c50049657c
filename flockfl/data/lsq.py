"""Heterogeneous least squares (spec ``core-and-clustered-algorithms.md`` §4.4): the sanity
problem on which client drift, objective inconsistency and cluster cycling are measured.

    A_j = (1 + j/3)·G_j,  G_j ~ N(0, 1)^{n×d};  x_j ~ N((j − m/2)·1, I);  b_j = A_j x_j + 0.1·ε
    x* = (Σ_j A_jᵀA_j)^{-1} Σ_j A_jᵀ b_j
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.engine.data import ClientData, Split


def hetero_lsq(m: int = 10, d: int = 20, n: int = 50, seed: int = 0) -> tuple[ClientData, np.ndarray, float]:
    """(client data, x*, L = max_j λ_max(A_jᵀA_j/n)); train and test are the same samples."""
    rng = np.random.default_rng(seed)
    A = [(1 + j / 3) * rng.standard_normal((n, d)) for j in range(m)]
    b = [A[j] @ rng.normal(j - m / 2, 1.0, d) + 0.1 * rng.standard_normal(n) for j in range(m)]
    x_star = np.linalg.solve(sum(a.T @ a for a in A), sum(a.T @ y for a, y in zip(A, b)))
    lam_max = max(np.linalg.eigvalsh(a.T @ a / n).max() for a in A)
    off = np.arange(0, m * n + 1, n)
    split = Split(torch.tensor(np.concatenate(A), dtype=torch.float32), torch.tensor(np.concatenate(b), dtype=torch.float32), off)
    return ClientData(split, split, -np.ones(m, np.int64), "regression", 0, (d,)), x_star, float(lam_max)


def lsq_config(algo: dict, m: int, train: dict, seed: int = 0) -> dict:
    """The raw config of a run of ``algo`` on ``m`` clients of :func:`hetero_lsq` (a linear
    model; every client each round unless ``train.clients_per_round`` says otherwise;
    full-batch local steps unless overridden); ``flockfl.preparation.prepare_data`` runs it."""
    return {"seed": seed, "dataset": {"name": "synthetic_linreg"}, "partition": {"scheme": "natural", "num_clients": m},
            "model": {"name": "linear"}, "algorithm": algo, "tracking": {"enabled": False},
            "train": {"clients_per_round": m, "full_batch": True, "engine": "vectorized", **train}}


def rel_error(state, x_star: np.ndarray) -> float:
    """‖x − x*‖/‖x*‖ of the first model's weights (float64)."""
    x = state.models["1.weight"][0, 0].double().numpy()
    return float(np.linalg.norm(x - x_star) / np.linalg.norm(x_star))
