"""CFL's maths on client updates (Sattler, Müller, Samek, arXiv 1910.01991): the pairwise cosine
similarities α_ij of the updates, and the bi-partition of a cluster that (single linkage, the
paper's Alg. 1) minimises the largest cross-cluster similarity, or the official code's complete
linkage on −α."""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import cut_tree
from scipy.cluster.hierarchy import linkage as scipy_linkage
from scipy.spatial.distance import squareform


def cosine_similarities(x: np.ndarray) -> np.ndarray:
    """α_ij = <x_i, x_j> / (‖x_i‖‖x_j‖ + 1e-12) of the rows of ``x`` (a zero row: 0), unit diagonal."""
    x = np.asarray(x, np.float64)
    norms = np.linalg.norm(x, axis=1)
    sim = (x @ x.T) / (np.outer(norms, norms) + 1e-12)
    sim = (sim + sim.T) / 2  # exactly symmetric
    np.fill_diagonal(sim, 1.0)
    return sim


def bipartition(sim: np.ndarray, linkage: str = "single") -> np.ndarray:
    """Labels 0/1 of the two clusters left by agglomerative clustering of ``1 − sim``
    (the partition of ``−sim``) when exactly two remain; the first point gets label 0.

    ``single``: start from singletons and join the clusters of the most similar remaining
    pair until two remain (Kruskal on the maximum similarity): the exact argmin over all
    bi-partitions of max_{i∈c1, j∈c2} α_ij. ``complete``: the official code's
    ``AgglomerativeClustering(linkage="complete")`` on −α. The cut follows the merge order, so
    tied heights still leave exactly two clusters."""
    if linkage not in ("single", "complete"):
        raise ValueError(f"bipartition: unknown linkage {linkage!r}; use single or complete")
    sim = np.asarray(sim, np.float64)
    n = len(sim)
    if n < 2:
        raise ValueError(f"bipartition: needs at least 2 points, got {n}")
    z = scipy_linkage(squareform(np.clip(1.0 - sim, 0.0, None), checks=False), method=linkage)
    labels = cut_tree(z, n_clusters=2).reshape(-1)
    return (labels != labels[0]).astype(np.int64)


def cross_max(sim: np.ndarray, labels: np.ndarray) -> float:
    """α_cross^max = max_{i∈c1, j∈c2} α_ij of a bi-partition."""
    a, b = labels == 0, labels == 1
    return float(np.asarray(sim)[np.ix_(a, b)].max())


def intra_min(sim: np.ndarray, labels: np.ndarray) -> float:
    """The smallest similarity within either side (1 when both sides are singletons)."""
    sim = np.asarray(sim)
    vals = [sim[np.ix_(m, m)].min() for m in (labels == 0, labels == 1) if m.sum() > 1]
    return float(min(vals)) if vals else 1.0


def gamma_bound(alpha_cross_max: float) -> float:
    """sqrt((1 − α_cross^max)/2): the split is provably correct for every γ_max below it."""
    return float(np.sqrt(max(0.0, 1.0 - alpha_cross_max) / 2.0))
