"""Clustering primitives: agglomerative clustering of a distance matrix (App. A.3), a newcomer's
linkage distance to existing clusters (PACFL's PME, Alg. 8), k-means, and FLIS-DC's overlapping
threshold clusters (Alg. 5)."""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster
from scipy.cluster.hierarchy import linkage as scipy_linkage
from scipy.spatial.distance import squareform

LINKAGES = ("weighted", "average", "complete", "single")


def renumber(labels: np.ndarray) -> np.ndarray:
    """Relabel to 0..Z−1 in order of first appearance (the first point gets label 0)."""
    labels = np.asarray(labels)
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


def hierarchical_clusters(dist: np.ndarray, *, threshold: float | None = None, n_clusters: int | None = None,
                          linkage: str = "weighted") -> np.ndarray:
    """Agglomerative clustering of a precomputed symmetric distance matrix (App. A.3, PACFL §3.4.2).

    Every point starts alone; the two closest clusters merge until either the closest pair is
    farther apart than ``threshold`` (scipy ``fcluster(criterion="distance")``: clusters whose
    merge height is ≤ threshold are joined) or ``n_clusters`` remain (``criterion="maxclust"``).
    Give exactly one of the two. Linkage: ``weighted`` (WPGMA: the distance to a merged cluster is
    the mean of the distances to its two halves, which is the PACFL code's "average"),
    ``average`` (UPGMA, mean over all member pairs), ``complete`` (max) or ``single`` (min).
    Uses ``scipy.cluster.hierarchy.linkage(squareform(dist, checks=False), method)``; only the
    upper triangle of ``dist`` is read. Returns int64 labels 0..Z−1 in order of first appearance.
    """
    if (threshold is None) == (n_clusters is None):
        raise ValueError("hierarchical_clusters: give exactly one of threshold and n_clusters")
    if linkage not in LINKAGES:
        raise ValueError(f"hierarchical_clusters: unknown linkage {linkage!r}; use one of {', '.join(LINKAGES)}")
    dist = np.asarray(dist, np.float64)
    n = len(dist)
    if dist.shape != (n, n):
        raise ValueError(f"hierarchical_clusters: dist must be square, got shape {dist.shape}")
    if n <= 1:
        return np.zeros(n, np.int64)
    z = scipy_linkage(squareform(dist, checks=False), method=linkage)
    if threshold is not None:
        labels = fcluster(z, t=float(threshold), criterion="distance")
    else:
        if n_clusters < 1:
            raise ValueError(f"hierarchical_clusters: n_clusters={n_clusters}; it must be at least 1")
        labels = fcluster(z, t=int(n_clusters), criterion="maxclust")
    return renumber(labels)


def point_to_cluster_distances(d: np.ndarray, labels: np.ndarray, linkage: str) -> np.ndarray:
    """The linkage distance from one new point to each cluster 0..max(labels) (PACFL PME, "stable").

    ``d[j]`` is the new point's distance to the already-clustered point j, whose cluster is
    ``labels[j]``. Single linkage takes the minimum over the cluster's members, complete the
    maximum, average and weighted the mean over the members (WPGMA's value would depend on the
    order in which the cluster was merged; the mean is the UPGMA value). A cluster id with no
    member gets inf.
    """
    if linkage not in LINKAGES:
        raise ValueError(f"point_to_cluster_distances: unknown linkage {linkage!r}; use one of {', '.join(LINKAGES)}")
    d = np.asarray(d, np.float64)
    labels = np.asarray(labels, np.int64)
    reduce = {"single": np.min, "complete": np.max, "average": np.mean, "weighted": np.mean}[linkage]
    z = int(labels.max()) + 1 if len(labels) else 0
    out = np.full(z, np.inf)
    for c in range(z):
        members = d[labels == c]
        if len(members):
            out[c] = reduce(members)
    return out


def kmeans_labels(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k-means labels of the rows of ``x`` (scikit-learn ``KMeans(n_clusters=k, n_init=10,
    random_state=seed)``), renumbered 0..k−1 in order of first appearance."""
    from sklearn.cluster import KMeans

    x = np.asarray(x, np.float64).reshape(len(x), -1)
    km = KMeans(n_clusters=int(k), n_init=10, random_state=int(seed)).fit(x)
    return renumber(km.labels_)


def kmeans_centres(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """The mean of each cluster's rows (k-means' centres at convergence), [k, D]; NaN for an empty cluster."""
    return np.stack([x[labels == j].mean(0) if (labels == j).any() else np.full(x.shape[1], np.nan) for j in range(k)])


def threshold_clusters(sim: np.ndarray, beta: float) -> list[np.ndarray]:
    """FLIS-DC's overlapping clusters (Alg. 5): C_i = sorted({j : sim[i, j] ≥ β} ∪ {i}), one per row.

    β = 0 puts every client with every other (FedAvg), β above every off-diagonal similarity
    leaves each client alone (SOLO)."""
    sim = np.asarray(sim)
    return [np.union1d(np.flatnonzero(sim[i] >= beta), [i]).astype(np.int64) for i in range(len(sim))]
