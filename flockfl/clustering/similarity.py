"""Similarities and distances between clients' outputs and label distributions.

- FLIS's inference similarity (thesis §3.3.2, Alg. 5): how alike two models' predictions on the
  server's data are.
- Label proportions (FedSC's data attribute I_i) and the label EMD used to measure label skew
  (NIID-Bench, thesis Table 5.3).
- ARI / NMI against a ground truth (scikit-learn's formulas, in NumPy: no import on a run's path).
- Embeddings of client updates for clustering: FlexCFL's EDC (Eq. 7) and IFCA's pre-training
  embeddings (per-layer unit blocks, raw updates, EDC).
"""

from __future__ import annotations

import numpy as np
import torch

SIMILARITY_FORMS = ("cosine_sum", "frobenius_hadamard")


def one_hot_predictions(logits: np.ndarray) -> np.ndarray:
    """B = one-hot of argmax over the last axis (the FLIS code's hard predictions), float64."""
    logits = np.asarray(logits)
    return (logits.argmax(-1)[..., None] == np.arange(logits.shape[-1])).astype(np.float64)


def inference_similarity(outputs: np.ndarray, form: str = "cosine_sum") -> np.ndarray:
    """FLIS's adjacency A between n models from their outputs B_i ∈ R^{M̃×C} on the server data
    (``outputs`` is [n, M̃, C], one-hot or soft), spec §1.2.

    - ``cosine_sum`` (FLIS code): A_ij = Σ_ab (B_i ⊙ B_j)_ab / (‖B_i‖_F ‖B_j‖_F), the cosine of
      the flattened outputs. Its diagonal is 1, and with one-hot B it is the fraction of server
      samples on which models i and j predict the same class.
    - ``frobenius_hadamard`` (thesis as printed): A_ij = ‖B_i ⊙ B_j‖_F / (‖B_i‖_F ‖B_j‖_F); with
      one-hot B it is √(agreement fraction / M̃) and its diagonal is 1/√M̃.

    A model whose outputs are all zero has similarity 0 to every model.
    """
    b = np.asarray(outputs, np.float64)
    f = b.reshape(len(b), -1)
    norms = np.linalg.norm(f, axis=1)
    denom = np.outer(norms, norms)
    if form == "cosine_sum":
        num = f @ f.T
    elif form == "frobenius_hadamard":
        sq = f * f
        num = np.sqrt(np.maximum(sq @ sq.T, 0.0))
    else:
        raise ValueError(f"inference_similarity: unknown form {form!r}; use one of {', '.join(SIMILARITY_FORMS)}")
    a = np.divide(num, denom, out=np.zeros_like(num), where=denom > 0)
    if form == "cosine_sum":
        np.fill_diagonal(a, (norms > 0).astype(np.float64))  # exactly 1, not 1 ± rounding
    return a


def label_proportions(hist: np.ndarray) -> np.ndarray:
    """I_i = [n_i1/n_i, …, n_iC/n_i] for every row of a label histogram (FedSC's data attribute);
    a row of zeros stays zero."""
    h = np.asarray(hist, np.float64)
    s = h.sum(-1, keepdims=True)
    return np.divide(h, s, out=np.zeros_like(h), where=s > 0)


def label_emd(p: np.ndarray, q: np.ndarray) -> float:
    """Earth mover's distance between two label distributions with the 0/1 ground distance
    (moving mass between any two different labels costs 1): EMD(p, q) = ½ Σ_c |p_c − q_c|, the
    total variation distance, in [0, 1] (0: same distribution, 1: disjoint labels).

    Zhao et al. (arXiv 1806.00582), whose label-skew measure NIID-Bench follows, report
    Σ_c |p_c − q_c| without the ½, i.e. twice this value.
    """
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    return float(0.5 * np.abs(p - q).sum())


def mean_pairwise(matrix: np.ndarray) -> float:
    """The mean of the off-diagonal upper triangle (i < j) of a square matrix; 0 for n < 2."""
    m = np.asarray(matrix, np.float64)
    iu = np.triu_indices(len(m), k=1)
    return float(m[iu].mean()) if len(iu[0]) else 0.0


def pairwise_label_emd(props: np.ndarray) -> np.ndarray:
    """[n, n] matrix of :func:`label_emd` between the rows of a proportions matrix."""
    props = np.asarray(props, np.float64)
    return 0.5 * np.abs(props[:, None, :] - props[None, :, :]).sum(-1)


def contingency(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[classes of a, classes of b] int64 counts of the pairs (a_i, b_i)."""
    _, ia = np.unique(np.asarray(a), return_inverse=True)
    _, ib = np.unique(np.asarray(b), return_inverse=True)
    out = np.zeros((ia.max(initial=-1) + 1, ib.max(initial=-1) + 1), np.int64)
    np.add.at(out, (ia.ravel(), ib.ravel()), 1)
    return out


def ari(a: np.ndarray, b: np.ndarray) -> float:
    """Adjusted Rand index, computed as scikit-learn's ``adjusted_rand_score`` (the pair
    confusion matrix in integers, then its formula; tests hold the two equal) without importing
    scikit-learn on a run's path."""
    c = contingency(a, b)
    n = int(c.sum())
    squares = int((c * c).sum())
    n_c, n_k = c.sum(1), c.sum(0)
    fp = int((c @ n_k).sum()) - squares
    fn = int((c.T @ n_c).sum()) - squares
    tp = squares - n
    tn = n * n - fp - fn - squares
    if fn == 0 and fp == 0:
        return 1.0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))


def _entropy(c: np.ndarray) -> float:
    p = c[c > 0].astype(np.float64)
    if p.size <= 1:
        return 0.0
    total = p.sum()
    return float(-np.sum((p / total) * (np.log(p) - np.log(total))))


def nmi(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised mutual information with the arithmetic mean of the entropies, computed as
    scikit-learn's ``normalized_mutual_info_score`` (same terms, same order of summation)."""
    c = contingency(a, b)
    if c.shape[0] == c.shape[1] and c.shape[0] <= 1:
        return 1.0
    if c.shape[0] == 1 or c.shape[1] == 1:
        return 0.0
    rows, cols = np.nonzero(c)  # row-major, as scipy's find on the CSR matrix
    val = c[rows, cols].astype(np.float64)
    total = val.sum()
    pi, pj = c.sum(1).astype(np.float64), c.sum(0).astype(np.float64)
    share = val / total
    outer = pi.take(rows).astype(np.int64) * pj.take(cols).astype(np.int64)
    log_outer = -np.log(outer) + np.log(pi.sum()) + np.log(pj.sum())
    mi = share * (np.log(val) - np.log(total)) + share * log_outer
    mi = np.where(np.abs(mi) < np.finfo(mi.dtype).eps, 0.0, mi)
    mi = float(np.clip(mi.sum(), 0.0, None))
    if mi == 0:
        return 0.0
    return float(mi / ((_entropy(c.sum(1)) + _entropy(c.sum(0))) / 2))


def edc_embedding(delta: np.ndarray, m: int, route: str = "gram", seed: int = 0) -> np.ndarray:
    """M_d (Eq. 7's embedding): [n, m] cosine similarities of each update row of ΔW with the m
    leading singular directions of ΔW.

    ``gram`` (default, exact): ΔW ΔWᵀ = U Σ² Uᵀ, cos(Δw_i, v_k) = σ_k U_ik / ‖Δw_i‖.
    ``svd``: the code's ``TruncatedSVD(m, random_state=seed).fit_transform(ΔWᵀ)`` then cosine
    similarity with its columns (randomized; the same up to column signs)."""
    delta = np.asarray(delta, np.float64)
    n = len(delta)
    m = max(1, min(int(m), n))
    norms = np.linalg.norm(delta, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    if route == "gram":
        evals, evecs = np.linalg.eigh(delta @ delta.T)
        order = np.argsort(evals)[::-1][:m]
        sig = np.sqrt(np.clip(evals[order], 0.0, None))
        return evecs[:, order] * sig[None, :] / safe[:, None]
    if route == "svd":
        from sklearn.decomposition import TruncatedSVD

        comps = TruncatedSVD(n_components=m, random_state=int(seed)).fit_transform(delta.T)  # [d, m] = U Σ of ΔWᵀ
        cn = np.linalg.norm(comps, axis=0)
        return (delta @ comps) / (safe[:, None] * np.where(cn > 0, cn, 1.0)[None, :])
    raise ValueError(f"edc_embedding: unknown route {route!r}; use gram or svd")


def update_embedding(blocks: list[torch.Tensor], how: str, k: int) -> np.ndarray:
    """The rows k-means clusters, from client updates Δ_i given as per-parameter blocks (float64
    [C, d_l], one per parameter, side by side they are Δ_i flattened):

    - ``layers``: each block scaled to unit norm, the blocks side by side; every layer's update
      *direction* counts once, whatever its size or step length;
    - ``updates``: Δ_i flattened;
    - ``edc``: FlexCFL's EDC embedding of Δ_i (:func:`edc_embedding` with m = k)."""
    if how == "layers":
        return torch.cat([b / b.norm(dim=1, keepdim=True).clamp_min(1e-300) for b in blocks], 1).numpy()
    updates = torch.cat(blocks, 1)
    return edc_embedding(updates.numpy(), k) if how == "edc" else updates.numpy()
