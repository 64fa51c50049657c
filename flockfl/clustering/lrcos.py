"""FedAC's clustering maths (Zhang et al., arXiv 2403.16460; see ``flockfl/algorithms/fedac.py``):
LrCos, the cosine of client and centroid vectors after a PCA projection M; the E-step
(argmax LrCos) and M-step (member means); the G_c ratios and one pass of Cluster Number Tuning
(merges by G_c < a, splits by G_c > b with spherical 2-means). Torch in, torch/NumPy out; no
state, no randomness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def _idx(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.int64)).to(device)


def pca_map(h: torch.Tensor, components: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, mean): M is the [D, dim] matrix of the top right singular vectors of the centred rows
    of ``h`` (D = min(components or 10, n − 1, numerical rank)), mean the rows' mean.

    The economy SVD is taken through the n × n Gram matrix (n = participants ≪ dim): its
    eigenvectors U give V = Hᵀ U / s, which is cheap and deterministic for wide matrices."""
    mean = h.mean(0)
    centred = (h - mean).double()
    evals, evecs = torch.linalg.eigh(centred @ centred.T)  # ascending
    s2, u = evals.flip(0), evecs.flip(1)
    limit = min(components if components is not None else 10, len(h) - 1)
    rank = int((s2 > max(float(s2[0]), 0.0) * 1e-10).sum()) if len(s2) and s2[0] > 0 else 0
    d = max(0, min(limit, rank))
    v = (centred.T @ u[:, :d]) / s2[:d].sqrt()
    return v.T.to(h.dtype).contiguous(), mean


def project(x: torch.Tensor, m: torch.Tensor, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mx for every row (x − mean when ``mean`` is given); raw x when M has no rows."""
    x = x - mean if mean is not None else x
    return x @ m.T if len(m) else x


def lrcos(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[n, K] cosine of every projected client vector with every projected centroid."""
    pn = p / p.norm(dim=1, keepdim=True).clamp_min(1e-30)
    qn = q / q.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return pn @ qn.T


def e_step(sim: torch.Tensor) -> np.ndarray:
    """R_i = argmax_k LrCos(ω_i, Ω_k), ties to the lowest k (the seed's argmin is a typo)."""
    return np.argmax(sim.cpu().numpy(), axis=1).astype(np.int64)


def m_step(x: torch.Tensor, labels: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """(centroids, labels): Ω_k = mean of the rows labelled k; empty clusters are dropped and
    the rest renumbered 0..K'−1 in their old order."""
    kept = np.unique(labels)
    new = np.searchsorted(kept, labels).astype(np.int64)
    cent = torch.stack([x[_idx(np.flatnonzero(new == j), x.device)].mean(0) for j in range(len(kept))])
    return cent, new


def gc_ratios(x: torch.Tensor, labels: np.ndarray, centroids: torch.Tensor) -> np.ndarray:
    """G_c^k = Dist_intra^k / Dist_inter^k for every cluster (K = 1: Dist_inter = ‖Ω_1‖²)."""
    k = len(centroids)
    c64 = centroids.double()
    intra = np.array([float(((x[_idx(np.flatnonzero(labels == j), x.device)].double() - c64[j]) ** 2).sum(1).mean())
                      for j in range(k)])
    if k == 1:
        inter = np.array([float((c64[0] ** 2).sum())])
    else:
        inter = (torch.cdist(c64, c64) ** 2).sum(1).cpu().numpy() / (k - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, intra / np.where(inter > 0, inter, 1.0), np.where(intra > 0, np.inf, 0.0))


def two_means_cosine(p: torch.Tensor, iters: int = 100) -> np.ndarray:
    """Spherical 2-means of the rows of ``p``: seeded with the two least similar rows (the first
    such pair), then Lloyd steps on cosine similarity until the labels settle. Deterministic."""
    pn = p.double().cpu()
    pn = pn / pn.norm(dim=1, keepdim=True).clamp_min(1e-30)
    sim = (pn @ pn.T).numpy()
    a, b = np.unravel_index(np.argmin(sim), sim.shape)
    centres = pn[[int(a), int(b)]]
    labels = None
    for _ in range(iters):
        new = np.argmax((pn @ centres.T).numpy(), axis=1).astype(np.int64)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        if len(np.unique(labels)) < 2:
            break
        centres = torch.stack([pn[torch.from_numpy(labels == j)].mean(0) for j in (0, 1)])
    return labels


@dataclass
class Tuning:
    labels: np.ndarray
    centroids: torch.Tensor
    merged: int
    split: int
    g: np.ndarray  # G_c of the clusters before tuning


def tune_clusters(x: torch.Tensor, proj: torch.Tensor, labels: np.ndarray, a: float, b: float,
                  cols: Optional[torch.Tensor] = None) -> Tuning:
    """One pass of Cluster Number Tuning (Algorithm 3) on the rows of ``x`` (full ω) with cluster
    ``labels`` (0..K−1, every cluster non-empty); ``proj`` holds the rows' projected vectors Mω_i
    (for the splits) and ``cols`` the coordinates the distances use (default: all)."""
    centroids, labels = m_step(x, labels)
    xs, cs = (x, centroids) if cols is None else (x[:, cols], centroids[:, cols])
    g = gc_ratios(xs, labels, cs)
    k = len(centroids)
    busy: set[int] = set()
    target = np.arange(k)
    merged = split = 0
    if k > 1:
        dist = torch.cdist(cs.double(), cs.double()).cpu().numpy()
        np.fill_diagonal(dist, np.inf)
        for j in sorted(range(k), key=lambda j: (g[j], j)):
            if not g[j] < a:
                break
            near = int(np.argmin(dist[j]))
            if j in busy or near in busy:
                continue
            busy |= {j, near}
            target[j] = near
            merged += 1
    out = target[labels]
    for j in range(k):
        members = np.flatnonzero(labels == j)
        if j in busy or not g[j] > b or len(members) < 2:
            continue
        halves = two_means_cosine(proj[_idx(members, proj.device)])
        if len(np.unique(halves)) < 2:
            continue
        out[members[halves == 1]] = k + split
        split += 1
    centroids, out = m_step(x, out)
    return Tuning(out, centroids, merged, split, g)


def coordinates(x: torch.Tensor, m: torch.Tensor, mean: Optional[torch.Tensor], cols: Optional[torch.Tensor]) -> torch.Tensor:
    """The vectors LrCos compares: the rows' coordinates ``cols`` (all when None), projected by M
    (after subtracting ``mean`` when given)."""
    return project(x if cols is None else x[:, cols], m, mean)


def em_step(x: torch.Tensor, labels: np.ndarray, centroids: Optional[torch.Tensor], scope: np.ndarray, m: torch.Tensor,
            mean: Optional[torch.Tensor], cols: Optional[torch.Tensor], a: float, b: float) -> Tuning:
    """One server step on the clients' vectors ``x`` (full ω, one row per client the server holds):
    when ``centroids`` is None, an M-step from ``labels`` first; then the E-step (argmax LrCos
    against the centroids) for the rows in ``scope``; then Cluster Number Tuning with thresholds
    a, b (−inf / inf: none)."""
    proj = coordinates(x, m, mean, cols)
    labels = np.array(labels, np.int64)
    if centroids is None:
        centroids, labels = m_step(x, labels)
    sim = lrcos(proj[_idx(np.flatnonzero(scope), proj.device)], coordinates(centroids, m, mean, cols))
    labels[scope] = e_step(sim)
    return tune_clusters(x, proj, labels, a, b, cols)
