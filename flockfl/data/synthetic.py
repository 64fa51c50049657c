"""The generated datasets, pure functions of the seed and their keys: ``synthetic_linreg``
(IFCA's mixture of linear regressions) and ``synthetic_fedprox`` (FedProx's Synthetic(α, β),
one natural client per device).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from flockfl.config import DatasetConfig
from flockfl.data.dataset import Dataset
from flockfl.errors import ConfigError
from flockfl.rng import np_rng


def make_synthetic_linreg(cfg: DatasetConfig, seed: int, num_clients: int) -> Dataset:
    """IFCA's mixture of linear regressions (spec §4.1).

    θ*_j = R·b_j with b_j ~ Bernoulli(0.5)^d; client i belongs to cluster ⌊i·k/m⌋ (contiguous
    equal blocks); x ~ N(0, I_d) and y = ⟨x, θ*⟩ + σ·ε.
    """
    num_clients = 10 if num_clients is None else num_clients  # partition.num_clients unset: the default 10
    k, d, n, n_te = cfg.clusters, cfg.dim, cfg.samples_per_client, cfg.test_samples_per_client
    if k > num_clients:
        raise ConfigError(f"dataset.clusters: {k} clusters need at least {k} clients (partition.num_clients={num_clients})")
    rng = np_rng(seed, purpose="synthetic_linreg")
    theta = cfg.separation * rng.binomial(1, 0.5, size=(k, d)).astype(np.float64)
    group = (np.arange(num_clients) * k) // num_clients
    xs, ys, xt, yt = [], [], [], []
    for i in range(num_clients):
        for n_i, xo, yo in ((n, xs, ys), (n_te, xt, yt)):
            x = rng.standard_normal((n_i, d))
            xo.append(x)
            yo.append(x @ theta[group[i]] + cfg.noise * rng.standard_normal(n_i))
    return Dataset(
        "synthetic_linreg",
        np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.float32),
        np.concatenate(xt).astype(np.float32), np.concatenate(yt).astype(np.float32),
        task="regression",
        client_train=np.repeat(np.arange(num_clients), n), client_test=np.repeat(np.arange(num_clients), n_te),
        group=group.astype(np.int64), meta={"theta": theta.astype(np.float32)},
    )


FEDPROX_FEATURES, FEDPROX_CLASSES = 60, 10


def make_synthetic_fedprox(cfg: DatasetConfig, seed: int, num_clients: Optional[int]) -> Dataset:
    """FedProx's Synthetic(α, β) (Li et al., arXiv 1812.06127; flexcfl.md §7), offline.

    60 features, 10 classes, N devices (``partition.num_clients``, 100 when unset, as in
    FlexCFL's Table II). Device k draws u_k ~ N(0, α) and B_k ~ N(0, β) (α = ``syn_alpha``,
    β = ``syn_beta``; the second argument is a standard deviation, as numpy's scale);
    W_k ∈ R^{60×10} and b_k ∈ R^10 with entries ~ N(u_k, 1); v_k ∈ R^60 with entries
    ~ N(B_k, 1); n_k = int(lognormal(4, 2)) + 50 samples x ~ N(v_k, Σ), Σ = diag(j^−1.2),
    j = 1..60, labelled y = argmax(x W_k + b_k) (softmax does not move the argmax). Each device's
    samples are shuffled and split int(0.9·n_k) train / the rest test. The device is the natural
    client (``client_train`` / ``client_test``), so ``partition.scheme=natural`` uses it; there
    is no ground-truth grouping (every device has its own model).

    Draws come from the (seed, "synthetic_fedprox") stream (sizes, u, B, then device by device
    v_k, W_k, b_k, x, shuffle), so the data is a pure function of (seed, α, β, N). Features are
    float32, labels int64.
    """
    n_dev = 100 if num_clients is None else int(num_clients)
    d, c = FEDPROX_FEATURES, FEDPROX_CLASSES
    rng = np_rng(seed, purpose="synthetic_fedprox")
    sizes = rng.lognormal(4, 2, n_dev).astype(np.int64) + 50
    u = rng.normal(0, cfg.syn_alpha, n_dev)  # mean of W_k and of b_k
    big_b = rng.normal(0, cfg.syn_beta, n_dev)  # mean of v_k
    sd = np.arange(1, d + 1, dtype=np.float64) ** -0.6  # √diag(Σ) = j^(−1.2/2)
    parts = {"xtr": [], "ytr": [], "xte": [], "yte": [], "ctr": [], "cte": []}
    for k in range(n_dev):
        v = rng.normal(big_b[k], 1, d)
        w = rng.normal(u[k], 1, (d, c))
        b = rng.normal(u[k], 1, c)
        x = v + sd * rng.standard_normal((sizes[k], d))
        y = np.argmax(x @ w + b, axis=1)
        order = rng.permutation(sizes[k])
        x, y = x[order], y[order]
        n_tr = int(0.9 * sizes[k])
        for key, arr in (("xtr", x[:n_tr]), ("ytr", y[:n_tr]), ("xte", x[n_tr:]), ("yte", y[n_tr:])):
            parts[key].append(arr)
        parts["ctr"].append(np.full(n_tr, k, np.int64))
        parts["cte"].append(np.full(sizes[k] - n_tr, k, np.int64))
    cat = lambda key: np.concatenate(parts[key])  # noqa: E731
    return Dataset(
        "synthetic_fedprox", cat("xtr").astype(np.float32), cat("ytr").astype(np.int64),
        cat("xte").astype(np.float32), cat("yte").astype(np.int64), num_classes=c,
        client_train=cat("ctr"), client_test=cat("cte"),
        meta={"alpha": cfg.syn_alpha, "beta": cfg.syn_beta, "devices": n_dev, "samples_per_device": sizes.tolist()},
    )
