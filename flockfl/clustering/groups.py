"""Group-level maths of FlexCFL / FedGroup (Duan et al.) and FeSEM (Long et al.), on float64
NumPy rows of flattened models or updates: k-means++ partitions, cosine and MADC (Eq. 6)
dissimilarities, the cold-start rule (Eq. 8), the Wasserstein-1 shift detectors (Eq. 9),
inter-group aggregation (§2.6, Eq. 20) and FeSEM's ℓ2 E-step. FlexCFL's EDC embedding (Eq. 7)
is :func:`flockfl.clustering.similarity.edc_embedding`."""

from __future__ import annotations

import numpy as np


def kmeans_partition(x: np.ndarray, m: int, random_state: int, max_iter: int = 20) -> np.ndarray:
    """K-means++ labels of the rows (sklearn, n_init=10 pinned), m clamped to the row count."""
    from sklearn.cluster import KMeans

    m = max(1, min(int(m), len(x)))
    km = KMeans(n_clusters=m, init="k-means++", n_init=10, max_iter=int(max_iter), random_state=int(random_state))
    return km.fit(np.asarray(x, np.float64)).labels_.astype(np.int64)


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[len(a), len(b)] cosine similarities (0 where a row has zero norm)."""
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    den = np.outer(na, nb)
    return np.divide(dots, den, out=np.zeros_like(dots), where=den > 0)


def madc_matrix(delta: np.ndarray) -> np.ndarray:
    """MADC (Eq. 6): (1/(n−2)) Σ_{z≠i,j} |S(i,z) − S(j,z)| on the full cosine matrix S."""
    s = cosine_matrix(delta, delta)
    n = len(s)
    if n <= 2:
        return np.zeros((n, n))
    total = np.abs(s[:, None, :] - s[None, :, :]).sum(-1)  # Σ over every z
    own = np.abs(np.diag(s)[:, None] - s.T) + np.abs(s - np.diag(s)[None, :])  # the z = i and z = j terms
    d = (total - own) / (n - 2.0)
    np.fill_diagonal(d, 0.0)
    return d


def eq8_assign(delta: np.ndarray, directions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 8: argmin_j (1 − cos(Δw_0^(g_j), Δw_pre))/2 (ties → the lowest index); returns
    (groups, the [n, m] dissimilarities)."""
    dis = (1.0 - cosine_matrix(delta, directions)) / 2.0
    return np.argmin(dis, axis=1).astype(np.int64), dis


def w1_sorted_counts(curr: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """The code's detector statistic per row: scipy's 1-D W1 between the C count values taken as
    samples = mean |sort(curr) − sort(prev)|."""
    curr, prev = np.atleast_2d(curr).astype(np.float64), np.atleast_2d(prev).astype(np.float64)
    return np.abs(np.sort(curr, 1) - np.sort(prev, 1)).mean(1)


def w1_labels(curr: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """W1 over the class indices 0..C−1 between the two normalised label distributions per row
    (Σ_k |CDF_curr(k) − CDF_prev(k)|); 0 when both are empty, C−1 when only one is."""
    curr, prev = np.atleast_2d(curr).astype(np.float64), np.atleast_2d(prev).astype(np.float64)
    sc, sp = curr.sum(1, keepdims=True), prev.sum(1, keepdims=True)
    p, q = curr / np.where(sc > 0, sc, 1), prev / np.where(sp > 0, sp, 1)
    out = np.abs(np.cumsum(p - q, 1))[:, :-1].sum(1)
    one_empty = (sc[:, 0] > 0) != (sp[:, 0] > 0)
    out[one_empty] = curr.shape[1] - 1
    return out


def shift_detected(curr: np.ndarray, prev: np.ndarray, n0: np.ndarray, ratio: float, mode: str) -> np.ndarray:
    """Eq. 9 per client: ``code``: W1(sorted counts) > ratio·n_i/C; ``label_aware``: W1 over
    labels > ratio."""
    if mode == "code":
        return w1_sorted_counts(curr, prev) > ratio * np.asarray(n0, np.float64) / np.atleast_2d(curr).shape[1]
    return w1_labels(curr, prev) > ratio


def label_counts(split, num_classes: int) -> np.ndarray:
    """[clients, C] training-label counts of every client of a split (``offsets``, ``y``)."""
    n = len(split.offsets) - 1
    owner = np.repeat(np.arange(n), np.diff(split.offsets))
    y = split.y.cpu().numpy().astype(np.int64)
    return np.bincount(owner * num_classes + y, minlength=n * num_classes).reshape(n, num_classes)


def inter_group(models: np.ndarray, eta: float, mode: str) -> np.ndarray:
    """Inter-group aggregation of flattened group models [g, d] (float64), each group using the
    others' pre-aggregation models (§2.6)."""
    g = len(models)
    if g < 2 or eta == 0:
        return models.copy()
    norms = np.linalg.norm(models, axis=1)
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    out = np.empty_like(models)
    for j in range(g):
        others = [l for l in range(g) if l != j]
        if mode == "paper":
            out[j] = models[j] + eta * (inv[others, None] * models[others]).sum(0)
        else:
            w = eta * inv[others]
            out[j] = (models[j] + (w[:, None] * models[others]).sum(0)) / (1.0 + w.sum())
    return out


def nearest_centers(points: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """argmin_j ‖x_i − c_j‖ for float64 rows (ties → the lowest index): FeSEM's E-step."""
    d = np.stack([np.linalg.norm(points - c[None, :], axis=1) for c in centers], 1)
    return np.argmin(d, axis=1).astype(np.int64)
