"""Data subspaces and the distances between them (PACFL, thesis §3.4 and App. A).

A data set of M samples with N features is the matrix D ∈ R^{N×M}, samples as columns, raw and
uncentred (spec ``flis-pacfl-scniid.md`` §0.1). Its signature is U_p, the p most significant
left singular vectors of D (truncated SVD, App. A.2). Two signatures are compared through their
principal angles (Eq. A.1) or the matched-column trace of Eq. 3.2. Distances are in degrees.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse.linalg

MEASURES = ("smallest_angle", "trace", "sum_angles", "official_min_pairwise")


def _flat(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(len(x), int(np.prod(x.shape[1:]))).astype(np.float64, copy=False)


def data_basis(x: np.ndarray, p: int, method: str = "svd") -> np.ndarray:
    """U_p: the p most significant left singular vectors of D = x_flatᵀ (App. A.2, thesis §3.4.1).

    ``x`` is [n_samples, ...features]; trailing axes are flattened and the raw values are used
    (no centring: a scale factor does not change U). Returns [n_features, p'] float64 with
    p' = min(p, n_samples, n_features).

    ``method="svd"`` (default) runs ``np.linalg.svd(D, full_matrices=False)`` like the PACFL code.
    ``method="gram"`` gets the same columns from the top-p eigenvectors of the smaller Gram
    matrix (DᵀD or DDᵀ, scipy ``eigsh`` from a fixed start vector): equal to the SVD's up to the
    sign of each column and rounding (~1e-14), and 5–50× faster on large data. Use it only with
    sign-invariant measures (everything but ``official_min_pairwise``).
    """
    xf = _flat(x)
    n, f = xf.shape
    if n == 0:
        raise ValueError("data_basis: no samples; a basis needs at least one sample")
    k = min(int(p), n, f)
    if k < 1:
        raise ValueError(f"data_basis: p={p}; p must be at least 1")
    if method == "svd" or k >= min(n, f) - 1:  # eigsh needs k < size − 1
        return np.linalg.svd(xf.T, full_matrices=False)[0][:, :k]
    if method != "gram":
        raise ValueError(f"data_basis: unknown method {method!r}; use 'svd' or 'gram'")
    try:
        if n < f:  # left vectors of D are D·v/σ for the eigenvectors v of DᵀD = x xᵀ (n×n)
            w, v = scipy.sparse.linalg.eigsh(xf @ xf.T, k=k, which="LA", v0=np.ones(n))
            u = xf.T @ v[:, np.argsort(-w, kind="stable")]
            norms = np.linalg.norm(u, axis=0)
            if (norms > 1e-9 * max(norms.max(), 1e-300)).all():  # else rank < k: the SVD completes the basis
                return u / norms
        else:  # eigenvectors of DDᵀ = xᵀx (f×f) are U itself
            w, v = scipy.sparse.linalg.eigsh(xf.T @ xf, k=k, which="LA", v0=np.ones(f))
            return v[:, np.argsort(-w, kind="stable")]
    except scipy.sparse.linalg.ArpackNoConvergence:
        pass
    return np.linalg.svd(xf.T, full_matrices=False)[0][:, :k]


def client_signature(x: np.ndarray, y: np.ndarray, p: int, mode: str = "per_class", method: str = "svd") -> np.ndarray:
    """PACFL's client signature (spec §2.1), [n_features, columns] float64.

    ``whole``: U_p of all local samples (thesis text). ``per_class``: [U_p^{ℓ_1}, …, U_p^{ℓ_L}],
    the U_p of each label ℓ the client holds, in ascending label order, stacked side by side
    (the official PACFL code).
    """
    if mode == "whole":
        return data_basis(x, p, method)
    if mode != "per_class":
        raise ValueError(f"client_signature: unknown mode {mode!r}; use 'per_class' or 'whole'")
    y = np.asarray(y)
    return np.hstack([data_basis(np.asarray(x)[y == c], p, method) for c in np.unique(y)])


def principal_angles(U: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Principal angles Θ_1 ≤ … ≤ Θ_min(p,q) between span(U) and span(W), in radians (Eq. A.1).

    U [N, p] and W [N, q] are taken to have orthonormal columns; p and q may differ. Uses
    ``scipy.linalg.subspace_angles`` (cosine formula for large angles, sine formula for small
    ones), which returns them in descending order; they are returned ascending here.
    """
    return scipy.linalg.subspace_angles(np.asarray(U, np.float64), np.asarray(W, np.float64))[::-1].copy()


def subspace_distance(U: np.ndarray, W: np.ndarray, measure: str) -> float:
    """The distance between two signatures, in degrees.

    - ``smallest_angle``: Eq. 3.1 / 5.1, Θ_1 (the smallest principal angle).
    - ``trace``: Eq. 3.2 / 5.2, tr(arccos(UᵀW)) = Σ_{k=1}^{min(p,q)} arccos(|u_kᵀ w_k|), the angles
      between columns matched in SVD order. The ``abs`` makes it invariant to the sign of a
      singular vector (the printed equation has none; without it the value is not defined).
    - ``sum_angles``: Σ_k Θ_k, the sum of all principal angles.
    - ``official_min_pairwise``: min_{a,b} arccos(clip(u_aᵀ w_b, −1, 1)), the official PACFL
      code's measure: ≥ Θ_1 and sign-sensitive (no ``abs``), kept for code parity.
    """
    U = np.asarray(U, np.float64)
    W = np.asarray(W, np.float64)
    if measure == "smallest_angle":
        return float(np.degrees(principal_angles(U, W)[0]))
    if measure == "sum_angles":
        return float(np.degrees(principal_angles(U, W).sum()))
    if measure == "trace":
        k = min(U.shape[1], W.shape[1])
        cos = np.abs(np.einsum("nk,nk->k", U[:, :k], W[:, :k]))
        return float(np.degrees(np.arccos(np.clip(cos, 0.0, 1.0)).sum()))
    if measure == "official_min_pairwise":
        return float(np.degrees(np.arccos(np.clip(U.T @ W, -1.0, 1.0)).min()))
    raise ValueError(f"subspace_distance: unknown measure {measure!r}; use one of {', '.join(MEASURES)}")


def proximity_matrix(bases: list[np.ndarray], measure: str) -> np.ndarray:
    """A_ij = subspace_distance(U_i, U_j) (Eq. 3.1/3.2/5.1/5.2), [n, n] symmetric with a zero
    diagonal, in degrees. Each pair is computed once (i < j) and mirrored."""
    n = len(bases)
    a = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            a[i, j] = a[j, i] = subspace_distance(bases[i], bases[j], measure)
    return a


def stacked_proximity(bases: list[np.ndarray], measure: str) -> np.ndarray:
    """:func:`proximity_matrix` for many bases of one shape [N, p], all pairs at once.

    Uses cos Θ_k = σ_k(U_iᵀU_j) (spec §0.2): one matrix product of all the bases, then a batched
    SVD of the p×p blocks. Measures ``smallest_angle``, ``sum_angles`` and ``trace``. Below about
    1e-4° the cosine formula is less exact than scipy's sine formula (an identical pair may read
    1e-6° instead of 0), which is immaterial for averages; use :func:`proximity_matrix` to cluster."""
    if measure not in ("smallest_angle", "sum_angles", "trace"):
        raise ValueError(f"stacked_proximity: measure {measure!r} is not supported; use smallest_angle, sum_angles or trace")
    n = len(bases)
    if n == 0:
        return np.zeros((0, 0))
    b = np.stack([np.asarray(u, np.float64) for u in bases])  # [n, N, p]: raises unless all shapes agree
    p = b.shape[2]
    flat = b.transpose(0, 2, 1).reshape(n * p, -1)
    g = (flat @ flat.T).reshape(n, p, n, p).transpose(0, 2, 1, 3)  # g[i, j] = U_iᵀ U_j
    if measure == "trace":
        cos = np.abs(np.diagonal(g, axis1=2, axis2=3))
        out = np.degrees(np.arccos(np.clip(cos, 0.0, 1.0)).sum(-1))
    else:
        sigma = np.clip(np.linalg.svd(g, compute_uv=False), 0.0, 1.0)  # descending: σ_1 = cos Θ_1
        theta = np.arccos(sigma)
        out = np.degrees(theta[..., 0] if measure == "smallest_angle" else theta.sum(-1))
    out = (out + out.T) / 2
    np.fill_diagonal(out, 0.0)
    return out


def cross_proximity(bases_a: list[np.ndarray], bases_b: list[np.ndarray], measure: str) -> np.ndarray:
    """A_ij = subspace_distance(a_i, b_j) in degrees, [len(a), len(b)] (PME's new–old block, Alg. 8)."""
    return np.array([[subspace_distance(u, w, measure) for w in bases_b] for u in bases_a]).reshape(len(bases_a), len(bases_b))
