"""The plain partition schemes, one function per scheme, each returning a
:class:`~flockfl.data.partition.Partition`: ``iid``, ``dirichlet`` (C-Dir(α)), ``shards``
(McMahan's or Sub-FedAvg's), ``shards_pct`` (C-NIID(ρ%)), ``pfllib_pat`` (PFLlib's pathological
split), ``rotated`` (IFCA's protocol, or disjoint groups), ``label_swap`` and ``natural`` (the
data's own clients). They deal the data with the shared machinery of :mod:`flockfl.data.partition`;
the registry of schemes by name is :mod:`flockfl.data.schemes`.
"""

from __future__ import annotations

import numpy as np

from flockfl.config import PartitionConfig
from flockfl.data.dataset import Dataset
from flockfl.data.partition import (Partition, _check_nonempty, _check_sizes, _client_labels, _contiguous_groups,
                                    _need_classes, _shard_deal, _split_among_owners, _split_even, _split_sizes,
                                    check_shards, dirichlet_split, label_histogram, labels_per_client,
                                    resolved_num_clients, split_test_like_train, uneven_sizes)
from flockfl.errors import ConfigError
from flockfl.rng import np_rng


def partition_iid(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    n = resolved_num_clients(cfg)
    _check_sizes(len(ds.y_train), n)
    rng = np_rng(seed, purpose="partition")
    train = _split_even(rng.permutation(len(ds.y_train)), n)
    test = _split_even(rng.permutation(len(ds.y_test)), n)
    if cfg.client_sizes == "uneven":
        train = _split_sizes(np.concatenate(train), uneven_sizes(len(ds.y_train), n, np_rng(seed, purpose="partition/sizes")))
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_dirichlet(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """C-Dir(α): per class c, q_c ~ Dir(α·1_N), and class c's samples are split among clients by
    q_c, by NIID-Bench's rule (balancing, at least 10 samples per client) or flockfl's earlier
    one (``partition.dirichlet_rule``; see :func:`dirichlet_split`)."""
    n = resolved_num_clients(cfg)
    _check_sizes(len(ds.y_train), n)
    rng = np_rng(seed, purpose="partition")
    train = dirichlet_split(ds.y_train, np.arange(ds.num_classes), n, cfg, rng)
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_shards(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """Pathological label skew (McMahan et al.): sort by label, cut into shards, deal
    ``classes_per_client`` shards to every client; the shards are the data cut in n·s (300
    samples each on MNIST with 100 clients × 2: McMahan's), or ``shard_size`` samples each
    (Sub-FedAvg's 250)."""
    n, s = resolved_num_clients(cfg), cfg.classes_per_client
    check_shards(n, s, cfg.shard_size, len(ds.y_train), "")
    rng = np_rng(seed, purpose="partition")
    train = _shard_deal(ds.y_train, np.arange(len(ds.y_train)), n, s, rng, cfg.shard_size)
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_shards_pct(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """C-NIID(ρ%), "Non-IID label skew (ρ%)" (thesis §3.3, NIID-Bench "noniid-#label"): every client
    holds max(1, round(ρ/100·C)) labels (ρ unset: 20), label i mod C plus random others; each
    class's samples are shuffled and split evenly among the clients that hold it."""
    _need_classes(ds, "shards_pct")
    n = resolved_num_clients(cfg)
    rho = 20.0 if cfg.rho is None else cfg.rho
    classes = np.arange(ds.num_classes)
    k = labels_per_client(rho, ds.num_classes)
    rng = np_rng(seed, purpose="partition")
    owned = [_client_labels(i, classes, k, rng) for i in range(n)]
    train = _split_among_owners(ds.y_train, owned, classes, rng)
    _check_nonempty(train, "partition.num_clients", f"{n} clients with {k} of {ds.num_classes} labels each split some "
                    "labels into more pieces than they have samples; lower num_clients or raise rho")
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng, random_ties=True)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {}, info={"labels_per_client": k})


def partition_pfllib_pat(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """PFLlib's pathological split (``separate_data(partition="pat", balance=False)``, its
    leaderboard's; spec ``personalised-baselines.md`` §12.2). Classes in order: class c goes to
    the first ⌈n/C·s⌉ clients, by id, that still hold fewer than s = ``classes_per_client``
    classes; its samples, in dataset order, are cut into sizes drawn uniformly from
    [max(⌊m/10⌋, 1), ⌊m⌋) for all of them but the last, which takes the rest (m: the class's
    samples per chosen client). With 20 clients, 10 classes and s = 2, clients 4g…4g+3 all hold
    classes 2g and 2g+1: the groups' label sets are disjoint, the sizes unequal. (PFLlib's lower
    bound also has least_samples/C, a few samples, below m/10 on its datasets.)"""
    _need_classes(ds, "pfllib_pat")
    n, s, num_classes = resolved_num_clients(cfg), cfg.classes_per_client, ds.num_classes
    rng = np_rng(seed, purpose="partition")
    left = np.full(n, s)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in range(num_classes):
        chosen = np.flatnonzero(left > 0)[: int(np.ceil(n / num_classes * s))]
        if len(chosen) == 0:  # every client holds s classes: the remaining classes go unused
            break
        idx = np.flatnonzero(ds.y_train == c)
        if len(idx) < len(chosen):
            raise ConfigError(f"partition.num_clients: class {c} has {len(idx)} samples for {len(chosen)} clients; "
                              "lower num_clients or classes_per_client")
        per = len(idx) / len(chosen)
        low = max(int(per / 10), 1)
        sizes = rng.integers(low, max(int(per), low + 1), size=len(chosen) - 1)
        for i, chunk in zip(chosen, np.split(idx, np.cumsum(sizes))):
            parts[i].append(chunk)
        left[chosen] -= 1
    # every client is filled (C·⌈n/C·s⌉ ≥ n·s places, each chunk ≥ 1 sample), so none is left empty
    train = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    hist = label_histogram(ds.y_train, train, num_classes)
    test = split_test_like_train(ds.y_test, hist, rng)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_rotated(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """k groups of clients (contiguous blocks); group j sees its images rotated by 360/k·j
    degrees (IFCA §4.2: 0°/90°/180°/270° for k = 4, 0°/180° for k = 2).

    ``rotated_mode=ifca`` (IFCA's code, spec ``core-and-clustered-algorithms.md`` §4.2): every
    group gets the *whole* training set, in a fresh permutation per group, as its m_j clients ×
    n samples (n = ``samples_per_client``, or all of it: ⌊N/m_j⌋), so every image is seen
    rotated by every group; with ``client_sizes=uneven`` DIFCA's sizes inside each group. Each
    group's clients share the whole test set in contiguous chunks. ``disjoint``: one IID split
    of the data over all clients (the rule before), so the groups' images differ."""
    if ds.x_train.ndim != 4:
        raise ConfigError(f"partition.scheme: 'rotated' needs image data; {ds.name} samples have shape {ds.input_shape}")
    if cfg.rotated_mode == "disjoint":
        p = partition_iid(ds, cfg, seed)
        p.group = _contiguous_groups(p.num_clients, cfg.k).astype(np.int64)
    else:
        p = _rotated_ifca(ds, cfg, seed)
    p.angle = (360.0 / cfg.k) * p.group
    return p


def _rotated_ifca(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """IFCA's rotated protocol (see :func:`partition_rotated`): group by group, a permutation of
    the whole training set from the (seed, "partition") stream, its first m_j·n samples dealt in
    consecutive chunks (DIFCA's uneven sizes from the (seed, "partition/sizes") stream)."""
    n = resolved_num_clients(cfg)
    group = _contiguous_groups(n, cfg.k).astype(np.int64)
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    rng, size_rng = np_rng(seed, purpose="partition"), np_rng(seed, purpose="partition/sizes")
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    test: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for j in range(cfg.k):
        members = np.flatnonzero(group == j)
        m = len(members)
        per = cfg.samples_per_client if cfg.samples_per_client is not None else n_train // m
        if per < 1 or m * per > n_train:
            raise ConfigError(f"partition.samples_per_client: group {j} has {m} clients × {per} samples but the training "
                              f"set has {n_train}; lower samples_per_client or num_clients")
        perm = rng.permutation(n_train)[: m * per]
        sizes = uneven_sizes(m * per, m, size_rng) if cfg.client_sizes == "uneven" else np.full(m, per)
        for i, part, chunk in zip(members, _split_sizes(perm, sizes), _split_even(np.arange(n_test), m)):
            train[i], test[i] = part.astype(np.int64), chunk.astype(np.int64)
    return Partition(train, test, group, np.zeros(n), None, {})


def label_swap_permutations(k: int, num_classes: int, mode: str, seed: int) -> np.ndarray:
    """π_0 = identity; π_j swaps labels (2(j−1) mod C, 2(j−1)+1 mod C), or random permutations."""
    perms = np.tile(np.arange(num_classes), (k, 1))
    rng = np_rng(seed, purpose="label_swap")
    for j in range(1, k):
        if mode == "random_perm":
            perms[j] = rng.permutation(num_classes)
        else:
            a, b = (2 * (j - 1)) % num_classes, (2 * (j - 1) + 1) % num_classes
            perms[j, a], perms[j, b] = b, a
    return perms


def partition_label_swap(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    if ds.task != "classification":
        raise ConfigError("partition.scheme: 'label_swap' needs a classification dataset")
    p = partition_iid(ds, cfg, seed)
    p.group = _contiguous_groups(p.num_clients, cfg.k).astype(np.int64)
    p.label_perm = label_swap_permutations(cfg.k, ds.num_classes, cfg.label_swap_mode, seed)[p.group]
    return p


def _rows_by_client(client: np.ndarray, n: int) -> list[np.ndarray]:
    """Each client's sample indices in increasing order (one stable sort, not n scans)."""
    client = np.asarray(client, np.int64)
    order = np.argsort(client, kind="stable")
    counts = np.bincount(client[(client >= 0) & (client < n)], minlength=n)[:n]
    start = int(np.searchsorted(client[order], 0))  # ids outside 0..n-1 (none in a valid file) are skipped
    return np.split(order[start:start + int(counts.sum())], np.cumsum(counts)[:-1])


def partition_natural(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    if ds.client_train is None:
        raise ConfigError(f"partition.scheme: 'natural' needs client ids in the dataset; {ds.name} has none (use iid, dirichlet, ...)")
    ids = np.unique(ds.client_train)
    if ids[0] != 0 or ids[-1] != len(ids) - 1:
        raise ConfigError(f"dataset client_train: natural client ids must be 0..{len(ids) - 1} with none missing; "
                          "renumber the clients in the file")
    if cfg.num_clients is not None and len(ids) != cfg.num_clients:
        raise ConfigError(
            f"partition.num_clients: the dataset has {len(ids)} natural clients but num_clients={cfg.num_clients}; "
            f"set partition.num_clients={len(ids)} or leave it unset"
        )
    train, test = _rows_by_client(ds.client_train, len(ids)), _rows_by_client(ds.client_test, len(ids))
    group = ds.group if ds.group is not None else -np.ones(len(ids), np.int64)
    if len(group) != len(ids):
        raise ConfigError(f"dataset group: {len(group)} entries for {len(ids)} clients; give one group per client")
    return Partition(train, test, np.asarray(group, np.int64), np.zeros(len(ids)), None, {})
