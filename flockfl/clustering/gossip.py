"""Decentralised averaging among clients' flattened models, in place on a float tensor: DIFCA's
symmetric pairwise gossip (Kirch 2024, Algorithm 1), the reference code's exchange
(jonaskir6/dfca) and the per-cluster token draw. No state; the randomness comes in as a
``numpy.random.Generator`` (or the (seed, round, cluster) streams of :mod:`flockfl.rng`)."""

from __future__ import annotations

import numpy as np
import torch

from flockfl.rng import np_rng


def pairwise_gossip(flat: torch.Tensor, sizes: np.ndarray, repeats: int, mode: str, weighting: str,
                    rng: np.random.Generator) -> int:
    """R repeats of symmetric pairwise exchange among the rows of ``flat`` ([m, P]: the local
    models of one cluster's members), in place; returns the number of exchanges.

    Both partners of an exchange take the same value, (θ_i + θ_j)/2 (``uniform``) or
    (n_iθ_i + n_jθ_j)/(n_i + n_j) (``samples``, each then holding (n_i + n_j)/2), so the
    members' (weighted) mean never changes. ``random_pairs``: in each repeat every member, in
    order, averages with a peer drawn uniformly from the others. ``matching``: each repeat
    averages the disjoint pairs of a random perfect matching at once."""
    m = flat.shape[0]
    if m < 2 or repeats == 0:
        return 0
    w = np.asarray(sizes, np.float64).copy() if weighting == "samples" else np.ones(m)
    exchanges = 0
    for _ in range(repeats):
        if mode == "matching":
            perm = rng.permutation(m)[: 2 * (m // 2)]
            a, b = perm[0::2], perm[1::2]
            share = torch.from_numpy(w[a] / (w[a] + w[b])).to(flat.dtype).to(flat.device).unsqueeze(1)
            ia, ib = torch.from_numpy(a).to(flat.device), torch.from_numpy(b).to(flat.device)
            mixed = flat[ia] * share + flat[ib] * (1 - share)
            flat[ia], flat[ib] = mixed, mixed
            w[a] = w[b] = (w[a] + w[b]) / 2
            exchanges += len(a)
        else:
            peers = (np.arange(m) + rng.integers(1, m, size=m)) % m
            for i, j in enumerate(peers):
                share = w[i] / (w[i] + w[j])
                mixed = flat[i] * share + flat[j] * (1 - share)
                flat[i], flat[j] = mixed, mixed
                w[i] = w[j] = (w[i] + w[j]) / 2
            exchanges += m
    return exchanges


def pick_tokens(assign: np.ndarray, k: int, seed: int, round: int) -> np.ndarray:
    """The cohort position of each cluster's token holder: one per non-empty cluster, uniform
    among its members (stream (seed, round, cluster, "difca/token")); −1 for a cluster nobody chose."""
    holder = np.full(k, -1, np.int64)
    for c in range(k):
        members = np.flatnonzero(assign == c)
        if len(members):
            holder[c] = members[np_rng(seed, round, c, "difca/token").integers(len(members))]
    return holder


def reference_threshold(m: int) -> int:
    """h = min(m − 1, 50 if m > 800 else 15): partner counts are drawn from U{1, …, h−1}."""
    return min(m - 1, 50 if m > 800 else 15)


def reference_gossip(flat: torch.Tensor, clusters: np.ndarray, rng: np.random.Generator) -> int:
    """The reference code's exchange, in place on ``flat`` ([m, k, P]: every participant's k
    copies) for participants with clusters ``clusters``; returns the number of exchanges."""
    m = len(clusters)
    h = reference_threshold(m)
    if h <= 1:
        return 0
    counts = rng.integers(1, h, size=m)
    lists = [list(rng.choice(np.delete(np.arange(m), i), size=int(counts[i]), replace=False)) for i in range(m)]
    exchanges = 0
    for i in range(m):
        for j in list(lists[i]):
            ci, cj = int(clusters[i]), int(clusters[j])
            alpha = 0.5 if ci == cj else 0.4
            flat[i, cj] = alpha * flat[i, cj] + (1 - alpha) * flat[j, cj]
            flat[j, ci] = alpha * flat[j, ci] + (1 - alpha) * flat[i, ci]
            exchanges += 1
            # the exchange counts against j's own draw as well
            if i in lists[j]:
                lists[j].remove(i)
            elif lists[j]:
                lists[j].pop(int(rng.integers(len(lists[j]))))
            else:
                for other in lists:
                    if j in other:
                        other.remove(j)
    return exchanges
