"""The super-cluster partitions (thesis §5.2, spec ``flis-pacfl-scniid.md`` §3.1–3.3:
``sc_niid``, ``sc_dir``) and MIX (one source per client, §3.5)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from flockfl.clustering import data_basis, hierarchical_clusters, proximity_matrix
from flockfl.config import PartitionConfig
from flockfl.data.dataset import Dataset
from flockfl.data.partition import (Partition, _check_nonempty, _check_sizes, _client_labels, _need_classes, _shard_deal,
                                    _split_among_owners, check_shards, dirichlet_split, label_histogram, labels_per_client,
                                    largest_remainder, resolved_num_clients, split_test_like_train)
from flockfl.errors import ConfigError
from flockfl.rng import np_rng


# ---------------------------------------------------------------------- super clusters (thesis §5.2)


def class_signatures(ds: Dataset, p: int) -> list[np.ndarray]:
    """U_p of every class's training samples, class 0 first (thesis §5.2.1, the inputs of Eq. 5.1).

    The top-p left singular vectors are found from the class's Gram matrix (``data_basis(...,
    method="gram")``): the same subspace as the SVD, and Eq. 5.1 does not see the signs."""
    out = []
    for c in range(ds.num_classes):
        xc = ds.x_train[ds.y_train == c]
        if len(xc) == 0:
            raise ConfigError(f"partition.scheme: class {c} of {ds.name} has no training samples, so it has no subspace "
                              "to cluster; use a scheme without super clusters")
        out.append(data_basis(xc, p, method="gram"))
    return out


def class_proximity(ds: Dataset, p: int) -> np.ndarray:
    """Eq. 5.1: A_ij = Θ_1(U_p^i, U_p^j) between the classes' subspaces, in degrees."""
    return proximity_matrix(class_signatures(ds, p), "smallest_angle")


def super_clusters(ds: Dataset, cfg: PartitionConfig, seed: int, prox: Optional[np.ndarray] = None) -> list[np.ndarray]:
    """The super clusters S_1..S_G: disjoint groups of classes (thesis §5.2.1, spec §3.1).

    Agglomerative clustering (``sc_linkage``) of the classes' Eq. 5.1 proximity matrix (U_p with
    p = ``sc_p``), cut at ``sc_threshold`` degrees when that is set, else into ``sc_clusters``
    groups. Deterministic (``seed`` is not drawn from). Each super cluster is the sorted array of
    its labels; super cluster 0 holds label 0."""
    _need_classes(ds, cfg.scheme)
    prox = class_proximity(ds, cfg.sc_p) if prox is None else prox
    if cfg.sc_threshold is not None:
        labels = hierarchical_clusters(prox, threshold=cfg.sc_threshold, linkage=cfg.sc_linkage)
    else:
        if cfg.sc_clusters > ds.num_classes:
            raise ConfigError(f"partition.sc_clusters: {cfg.sc_clusters} super clusters but {ds.name} has only "
                              f"{ds.num_classes} classes; set sc_clusters to at most {ds.num_classes}")
        labels = hierarchical_clusters(prox, n_clusters=cfg.sc_clusters, linkage=cfg.sc_linkage)
    return [np.flatnonzero(labels == g).astype(np.int64) for g in range(int(labels.max()) + 1)]


def clients_per_group(sizes: np.ndarray, n: int) -> np.ndarray:
    """n_g ∝ the groups' sample counts (largest remainder, summing to n), then at least one client
    per group when n allows it (taken from the group with the most clients)."""
    counts = largest_remainder(np.asarray(sizes, np.float64), n)
    if n >= len(counts):
        for g in np.flatnonzero(counts == 0):
            counts[int(np.argmax(counts))] -= 1
            counts[g] = 1
    return counts


def _assign_groups(counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A group per client: n_g clients for group g, the clients drawn by a random permutation."""
    group = np.empty(int(counts.sum()), np.int64)
    group[rng.permutation(len(group))] = np.repeat(np.arange(len(counts)), counts)
    return group


def _super_cluster_setup(ds: Dataset, cfg: PartitionConfig, seed: int):
    _need_classes(ds, cfg.scheme)
    n = resolved_num_clients(cfg)
    _check_sizes(len(ds.y_train), n)
    prox = class_proximity(ds, cfg.sc_p)
    scs = super_clusters(ds, cfg, seed, prox)
    sizes = np.array([np.isin(ds.y_train, sc).sum() for sc in scs])
    counts = clients_per_group(sizes, n)
    rng = np_rng(seed, purpose="partition")
    group = _assign_groups(counts, rng)
    info = {"super_clusters": [sc.tolist() for sc in scs], "clients_per_super_cluster": counts.tolist(),
            "class_angles_deg": np.round(prox, 3).tolist(), "sc_p": cfg.sc_p}
    return n, scs, group, rng, info


def partition_sc_niid(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """SC-NIID (thesis §5.2.2, spec §3.3): every client draws from one super cluster only.

    Clients go to super clusters in proportion to their sample counts (random clients). Inside
    super cluster g with n_g clients: with ``rho`` unset (SC-NIID(2)), its samples sorted by label
    are cut into ``classes_per_client``·n_g shards (of ``shard_size`` samples when set) and every
    client gets ``classes_per_client`` random shards; with ``rho`` set (SC-NIID(ρ%)), every client holds max(1, round(ρ/100·|S_g|))
    of the super cluster's labels (NIID-Bench's rule inside S_g) and each label is split evenly
    among its holders. ``group`` is the client's super cluster."""
    n, scs, group, rng, info = _super_cluster_setup(ds, cfg, seed)
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for g, sc in enumerate(scs):
        members = np.flatnonzero(group == g)
        if len(members) == 0:
            continue
        idx = np.flatnonzero(np.isin(ds.y_train, sc))
        if cfg.rho is None:
            s = cfg.classes_per_client
            check_shards(len(members), s, cfg.shard_size, len(idx), f" in super cluster {g}")
            parts = _shard_deal(ds.y_train, idx, len(members), s, rng, cfg.shard_size)
        else:
            k = labels_per_client(cfg.rho, len(sc))
            owned = [_client_labels(j, sc, k, rng) for j in range(len(members))]
            parts = _split_among_owners(ds.y_train, owned, sc, rng)
        for i, part in zip(members, parts):
            train[i] = part
    _check_nonempty(train, "partition.num_clients", "some super cluster has fewer samples per label than clients; "
                    "lower num_clients, raise rho or use fewer super clusters")
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng, random_ties=True)
    return Partition(train, test, group, np.zeros(n), None, {}, info=info)


def partition_sc_dir(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """SC-Dir(α) (thesis §5.2.2): clients go to super clusters as in SC-NIID; inside each super
    cluster, C-Dir(α) over its classes and its clients only, by the configured Dirichlet rule
    (``partition.dirichlet_rule``, N/n and the minimum size taken per super cluster). ``group``
    is the super cluster."""
    n, scs, group, rng, info = _super_cluster_setup(ds, cfg, seed)
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for g, sc in enumerate(scs):
        members = np.flatnonzero(group == g)
        if len(members) == 0:
            continue
        parts = dirichlet_split(ds.y_train, sc, len(members), cfg, rng, where=f" of super cluster {g}")
        for i, part in zip(members, parts):
            train[i] = part
    _check_nonempty(train, "partition.num_clients", "a super cluster has fewer samples than clients; lower num_clients")
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng, random_ties=True)
    return Partition(train, test, group, np.zeros(n), None, {}, info=info)


# ---------------------------------------------------------------------- mix (thesis §3.5)


def _balanced_quota(m: int, avail: np.ndarray) -> np.ndarray:
    """m samples spread over the classes as evenly as ``avail`` (samples per class) allows:
    water-filling, the last few to the classes with the most left (ties: the lower class)."""
    q = np.zeros(len(avail), np.int64)
    rest = int(m)
    while rest > 0:
        room = avail - q
        active = np.flatnonzero(room > 0)
        share = rest // len(active)
        if share == 0:
            q[active[np.argsort(-room[active], kind="stable")[:rest]]] += 1
            break
        add = np.minimum(share, room[active])
        q[active] += add
        rest -= int(add.sum())
    return q


def balanced_allocation(k: int, m: int, avail: np.ndarray) -> np.ndarray:
    """[k, classes] counts: k clients × m samples, as class-balanced as ``avail`` allows.

    The class totals T_c are water-filled (:func:`_balanced_quota` of k·m); each client then gets
    ⌊T_c/k⌋ of class c, and the remainders are dealt round-robin (class by class, client after
    client), so every count is ⌊T_c/k⌋ or ⌈T_c/k⌉ and every client gets exactly m."""
    total = _balanced_quota(k * m, np.asarray(avail, np.int64))
    q = np.tile(total // k, (k, 1))
    extras = np.repeat(np.arange(len(total)), total - k * (total // k))
    q[np.arange(len(extras)) % k, extras] += 1
    return q


def partition_mix(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """MIX (thesis §3.5, adapted): every client holds data of exactly one source of a ``mix``
    dataset; ``group`` is that source.

    Clients are split across the S sources as evenly as possible, in contiguous blocks (the
    remainder to the first sources). Within a source every client gets ``samples_per_client``
    samples (unset: min(500, the source's training samples // its clients)), class-balanced as far
    as the classes allow (500 of 10 classes: 50 per class, as in MIX-4), drawn without
    replacement. Test sets follow the train class proportions, from the source's own test data."""
    if ds.source_train is None:
        raise ConfigError(f"partition.scheme: 'mix' needs data from several sources but dataset {ds.name!r} is one; "
                          "set dataset.name=mix or choose another scheme")
    n = resolved_num_clients(cfg)
    names = ds.meta.get("sources") or [str(s) for s in range(int(ds.source_train.max()) + 1)]
    n_src = len(names)
    if n < n_src:
        raise ConfigError(f"partition.num_clients: mix needs at least one client per source ({n_src}: "
                          f"{', '.join(names)}); set num_clients to {n_src} or more")
    counts = np.array([n // n_src + (1 if s < n % n_src else 0) for s in range(n_src)], np.int64)
    group = np.repeat(np.arange(n_src), counts).astype(np.int64)
    rng = np_rng(seed, purpose="partition")
    train: list[np.ndarray] = []
    per_client = []
    for s in range(n_src):
        idx = np.flatnonzero(ds.source_train == s)
        k = int(counts[s])
        m = cfg.samples_per_client if cfg.samples_per_client is not None else min(500, len(idx) // k)
        if m < 1 or m * k > len(idx):
            raise ConfigError(f"partition.samples_per_client: source {names[s]} has {len(idx)} training samples for "
                              f"{k} clients × {m}; lower samples_per_client or num_clients")
        classes = np.unique(ds.y_train[idx])
        pools = [rng.permutation(idx[ds.y_train[idx] == c]) for c in classes]
        quota = balanced_allocation(k, m, np.array([len(pl) for pl in pools]))
        start = np.vstack([np.zeros(len(classes), np.int64), np.cumsum(quota, axis=0)])
        for j in range(k):
            take = [pl[a:a + t] for pl, a, t in zip(pools, start[j], quota[j])]
            train.append(np.sort(np.concatenate(take)).astype(np.int64))
        per_client.append(int(m))
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for s in range(n_src):
        members = np.flatnonzero(group == s)
        src_test = np.flatnonzero(ds.source_test == s)
        for i, t in zip(members, split_test_like_train(ds.y_test[src_test], hist[members], rng, random_ties=True)):
            test[i] = src_test[t]
    info = {"sources": list(names), "clients_per_source": counts.tolist(), "samples_per_client": per_client}
    return Partition(train, test, group, np.zeros(n), None, {}, info=info)
