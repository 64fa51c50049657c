"""Partition schemes: one function per scheme, all returning a :class:`Partition`.

A partition gives every client its train and test indices, its transform (a rotation, a
label permutation) and its ground-truth group where the scheme defines one. Each client's
test split follows its train distribution: a label-skewed client gets a test set with the
same class proportions. Partitions are deterministic given their config and seed, saved as
``data/partitions/<name>.npz`` plus a JSON summary, and addressed by content hash.

Schemes: ``iid``, ``dirichlet`` (C-Dir(α)), ``shards`` (McMahan's pathological shards),
``shards_pct`` (C-NIID(ρ%), NIID-Bench's "noniid-#label"), ``rotated``, ``label_swap``,
``natural``, ``sc_niid`` / ``sc_dir`` (super-cluster partitions, thesis §5.2, spec
``flis-pacfl-scniid.md`` §3.1–3.3) and ``mix`` (one source per client, MIX-4, §3.5).

With ``partition.server_holdout = h > 0`` a stratified random subset of h training samples is
kept out of every client as the server's own data (FLIS's auxiliary set): the scheme runs on the
remaining samples and the held-out ones are the partition's ``server_idx``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from flockfl.clustering import data_basis, hierarchical_clusters, proximity_matrix
from flockfl.errors import ConfigError
from flockfl.config import ExperimentConfig, PartitionConfig
from flockfl.data.datasets import Dataset
from flockfl.rng import np_rng
from flockfl.state import atomic_write

FORMAT_VERSION = 1


@dataclass
class Partition:
    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    group: np.ndarray  # ground-truth group per client, -1 where the scheme defines none
    angle: np.ndarray  # rotation in degrees per client (counter-clockwise)
    label_perm: Optional[np.ndarray]  # (clients, classes) label map per client, or None
    key: dict
    content_hash: str = ""
    # training samples held out for the server (FLIS's auxiliary data), in random order
    server_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # JSON-able facts about how the scheme split the data (super clusters, mix sources, the
    # heterogeneity measures once computed); saved, but not part of the content hash
    info: dict = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def has_groups(self) -> bool:
        return bool((self.group >= 0).all())

    def train_sizes(self) -> np.ndarray:
        return np.array([len(i) for i in self.train_idx])

    def test_sizes(self) -> np.ndarray:
        return np.array([len(i) for i in self.test_idx])


# ---------------------------------------------------------------------- helpers


def _split_even(idx: np.ndarray, n: int) -> list[np.ndarray]:
    return [np.sort(a) for a in np.array_split(idx, n)]


def _contiguous_groups(num_clients: int, k: int) -> np.ndarray:
    return (np.arange(num_clients) * k) // num_clients


def label_histogram(y: np.ndarray, idx: list[np.ndarray], num_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[i], minlength=num_classes) for i in idx]) if idx else np.zeros((0, num_classes))


def split_test_like_train(y_test: np.ndarray, hist: np.ndarray, rng: np.random.Generator,
                          random_ties: bool = False) -> list[np.ndarray]:
    """Give every client test samples with its train class proportions.

    Each class's test indices are shuffled and cut in proportion to the clients' train
    counts of that class (largest-remainder rounding, so every sample is used once). Equal
    remainders go to the lower client ids, or with ``random_ties`` (the schemes added with the
    super clusters) to clients drawn at random per class, so that when many clients hold the
    same counts and a class has few test samples the last clients are not always left out.
    """
    num_clients, num_classes = hist.shape
    out: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(y_test == c))
        w = hist[:, c].astype(np.float64)
        if w.sum() == 0 or len(idx) == 0:
            continue
        share = w / w.sum() * len(idx)
        counts = np.floor(share).astype(int)
        rest = len(idx) - counts.sum()
        if random_ties:
            order = np.lexsort((rng.permutation(num_clients), -np.round(share - counts, 9)))
        else:
            order = np.argsort(-(share - counts), kind="stable")
        counts[order[:rest]] += 1
        for i, part in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            out[i].append(part)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in out]


def resolved_num_clients(cfg: PartitionConfig, ds: Optional[Dataset] = None) -> int:
    """``partition.num_clients``, or when it is unset: 10, except with ``scheme=natural``, where it
    is the number of natural clients in the data (``ds`` must then be given)."""
    if cfg.num_clients is not None:
        return int(cfg.num_clients)
    if cfg.scheme == "natural" and ds is not None and ds.client_train is not None:
        return int(len(np.unique(ds.client_train)))
    return 10


def _check_sizes(n_train: int, n: int) -> None:
    if n > n_train:
        raise ConfigError(f"partition.num_clients: {n} clients but only {n_train} training samples; use fewer clients")


def _need_classes(ds: Dataset, scheme: str) -> None:
    if ds.task != "classification":
        raise ConfigError(f"partition.scheme: {scheme!r} splits by label and needs a classification dataset; {ds.name} "
                          "has float labels (use iid or natural)")


def _check_nonempty(train: list[np.ndarray], key: str, fix: str) -> None:
    empty = [i for i, t in enumerate(train) if len(t) == 0]
    if empty:
        raise ConfigError(f"{key}: {len(empty)} client(s) (first: {empty[0]}) would get no training samples; {fix}")


def largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts proportional to ``weights`` that sum to ``total`` (Hamilton's method: floor
    of each share, then one more to the largest fractional parts, ties to the lower index)."""
    w = np.asarray(weights, np.float64)
    share = w / w.sum() * total
    counts = np.floor(share).astype(np.int64)
    rest = int(total - counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    return counts


def labels_per_client(rho: float, num_labels: int) -> int:
    """max(1, round(ρ/100 · L)) labels (halves round up: ρ=25 of 10 labels gives 3)."""
    return max(1, min(num_labels, int(np.floor(rho / 100.0 * num_labels + 0.5))))


def _client_labels(position: int, pool: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """NIID-Bench's "noniid-#label" choice: the client at ``position`` always gets
    pool[position mod |pool|] plus k−1 further distinct labels drawn at random from the pool."""
    first = pool[position % len(pool)]
    others = rng.choice(np.setdiff1d(pool, [first]), size=k - 1, replace=False) if k > 1 else np.zeros(0, pool.dtype)
    return np.sort(np.concatenate([[first], others])).astype(np.int64)


def _split_among_owners(y: np.ndarray, owned: list[np.ndarray], classes: np.ndarray,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's samples, shuffled, are split evenly (``np.array_split``) among the clients
    that own the class, in client order; a class that no client owns is left unused."""
    parts: list[list[np.ndarray]] = [[] for _ in owned]
    for c in classes:
        owners = [i for i, labels in enumerate(owned) if c in labels]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for i, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def _dirichlet_split(y: np.ndarray, classes: np.ndarray, n: int, alpha: float, rng: np.random.Generator,
                     min_size: int, max_tries: int) -> Optional[list[np.ndarray]]:
    """Per class c: q_c ~ Dir(α·1_n), and class c's samples are split among the n clients by q_c;
    redrawn until every client has ``min_size`` samples (None after ``max_tries`` draws)."""
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            q = rng.dirichlet(np.full(n, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for i, p in enumerate(np.split(idx, cuts)):
                parts[i].append(p)
        train = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(t) for t in train) >= min_size:
            return train
    return None


def _shard_deal(y: np.ndarray, idx: np.ndarray, n: int, s: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sort ``idx`` by label (a random order within a label), cut it into n·s shards and deal s
    random shards to each of n clients (McMahan et al.)."""
    order = rng.permutation(idx)
    order = order[np.argsort(y[order], kind="stable")]
    shards = np.array_split(order, n * s)
    deal = rng.permutation(n * s).reshape(n, s)
    return [np.sort(np.concatenate([shards[j] for j in row])) for row in deal]


# ---------------------------------------------------------------------- schemes


def partition_iid(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    n = resolved_num_clients(cfg)
    _check_sizes(len(ds.y_train), n)
    rng = np_rng(seed, purpose="partition")
    train = _split_even(rng.permutation(len(ds.y_train)), n)
    test = _split_even(rng.permutation(len(ds.y_test)), n)
    if cfg.client_sizes == "uneven":
        train = _split_sizes(np.concatenate(train), uneven_sizes(len(ds.y_train), n, np_rng(seed, purpose="partition/sizes")))
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def uneven_sizes(total: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """DIFCA's client sizes (spec ``core-and-clustered-algorithms.md`` §4.3): randint(1, 2⌊N/m⌋)
    rescaled to sum to N, the last client taking the remainder, every size at least 1."""
    sizes = rng.integers(1, max(2, 2 * (total // n)), size=n)
    sizes = np.maximum(1, (sizes / sizes.sum() * total).astype(np.int64))
    sizes[-1] = max(1, total - sizes[:-1].sum())
    while sizes.sum() > total:  # the clamps to 1 can overshoot by a few samples: take them from the largest
        sizes[np.argmax(sizes)] -= sizes.sum() - total
    return sizes


def _split_sizes(perm: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return [np.sort(part) for part in np.split(perm, np.cumsum(sizes)[:-1])]


def partition_dirichlet(ds: Dataset, cfg: PartitionConfig, seed: int, min_size: int = 2, max_tries: int = 1000) -> Partition:
    """C-Dir(α): per class c, q_c ~ Dir(α·1_N), and class c's samples are split among clients by q_c."""
    n = resolved_num_clients(cfg)
    _check_sizes(len(ds.y_train), n)
    min_size = min(min_size, len(ds.y_train) // n)
    rng = np_rng(seed, purpose="partition")
    train = _dirichlet_split(ds.y_train, np.arange(ds.num_classes), n, cfg.alpha, rng, min_size, max_tries)
    if train is None:
        raise ConfigError(
            f"partition.alpha: Dirichlet({cfg.alpha}) left a client with under {min_size} samples after {max_tries} draws; "
            "raise alpha or lower num_clients"
        )
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_shards(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """Pathological label skew (McMahan et al.): sort by label, cut into shards, deal
    ``classes_per_client`` shards to every client."""
    n, s = resolved_num_clients(cfg), cfg.classes_per_client
    if n * s > len(ds.y_train):
        raise ConfigError(
            f"partition.classes_per_client: {n}×{s}={n * s} shards but only {len(ds.y_train)} training samples; "
            "lower num_clients or classes_per_client"
        )
    rng = np_rng(seed, purpose="partition")
    train = _shard_deal(ds.y_train, np.arange(len(ds.y_train)), n, s, rng)
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


def partition_rotated(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """k groups of clients; group j sees its images rotated by 360/k·j degrees (IFCA §4.2)."""
    if ds.x_train.ndim != 4:
        raise ConfigError(f"partition.scheme: 'rotated' needs image data; {ds.name} samples have shape {ds.input_shape}")
    p = partition_iid(ds, cfg, seed)
    p.group = _contiguous_groups(p.num_clients, cfg.k).astype(np.int64)
    p.angle = (360.0 / cfg.k) * p.group
    return p


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
    are cut into ``classes_per_client``·n_g shards and every client gets ``classes_per_client``
    random shards; with ``rho`` set (SC-NIID(ρ%)), every client holds max(1, round(ρ/100·|S_g|))
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
            if len(members) * s > len(idx):
                raise ConfigError(f"partition.classes_per_client: super cluster {g} has {len(idx)} samples for "
                                  f"{len(members)}×{s} shards; lower num_clients or classes_per_client")
            parts = _shard_deal(ds.y_train, idx, len(members), s, rng)
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


def partition_sc_dir(ds: Dataset, cfg: PartitionConfig, seed: int, min_size: int = 2, max_tries: int = 1000) -> Partition:
    """SC-Dir(α) (thesis §5.2.2): clients go to super clusters as in SC-NIID; inside each super
    cluster, C-Dir(α) over its classes and its clients only. ``group`` is the super cluster."""
    n, scs, group, rng, info = _super_cluster_setup(ds, cfg, seed)
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for g, sc in enumerate(scs):
        members = np.flatnonzero(group == g)
        if len(members) == 0:
            continue
        m = int(np.isin(ds.y_train, sc).sum())
        floor = min(min_size, m // len(members))
        parts = _dirichlet_split(ds.y_train, sc, len(members), cfg.alpha, rng, floor, max_tries)
        if parts is None:
            raise ConfigError(f"partition.alpha: Dirichlet({cfg.alpha}) left a client of super cluster {g} with under "
                              f"{floor} samples after {max_tries} draws; raise alpha or lower num_clients")
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


SCHEMES = {
    "iid": partition_iid,
    "dirichlet": partition_dirichlet,
    "shards": partition_shards,
    "rotated": partition_rotated,
    "label_swap": partition_label_swap,
    "natural": partition_natural,
    "shards_pct": partition_shards_pct,
    "sc_niid": partition_sc_niid,
    "sc_dir": partition_sc_dir,
    "mix": partition_mix,
}


# ---------------------------------------------------------------------- server hold-out


def server_holdout_indices(ds: Dataset, h: int, seed: int) -> np.ndarray:
    """h training samples for the server (FLIS's auxiliary data), stratified by class: class c
    gives h·n_c/n of them (largest remainder), drawn at random from the (seed, "server_holdout")
    stream; returned in random order, so that any prefix is a random subset too."""
    n = len(ds.y_train)
    if h >= n:
        raise ConfigError(f"partition.server_holdout: {h} server samples but only {n} training samples; "
                          f"hold out fewer than {n}")
    rng = np_rng(seed, purpose="server_holdout")
    if ds.task != "classification":
        return rng.choice(n, size=h, replace=False).astype(np.int64)
    classes, sizes = np.unique(ds.y_train, return_counts=True)
    take = largest_remainder(sizes, h)
    held = np.concatenate([rng.choice(np.flatnonzero(ds.y_train == c), size=t, replace=False) for c, t in zip(classes, take)])
    return rng.permutation(held).astype(np.int64)


def _train_subset(ds: Dataset, keep: np.ndarray) -> Dataset:
    """The dataset with only the training samples ``keep`` (test data unchanged)."""
    sub = lambda a: None if a is None else a[keep]  # noqa: E731
    return dataclasses.replace(ds, x_train=ds.x_train[keep], y_train=ds.y_train[keep],
                               client_train=sub(ds.client_train), source_train=sub(ds.source_train))


def make_partition(ds: Dataset, cfg: ExperimentConfig) -> Partition:
    """Run the configured scheme, after holding out ``partition.server_holdout`` training samples
    for the server (unset counts as 0 here: the config resolves it from the algorithm)."""
    h = cfg.partition.server_holdout or 0
    scheme = SCHEMES[cfg.partition.scheme]
    if h > 0:
        held = server_holdout_indices(ds, h, cfg.seed)
        keep = np.setdiff1d(np.arange(len(ds.y_train)), held)
        part = scheme(_train_subset(ds, keep), cfg.partition, cfg.seed)
        part.train_idx = [keep[i].astype(np.int64) for i in part.train_idx]
        part.server_idx = held
    else:
        part = scheme(ds, cfg.partition, cfg.seed)
    if cfg.partition.difficulty_fraction is not None:  # Algorithm 2: same class counts, controlled difficulty
        from flockfl.data import difficulty

        if ds.task != "classification":
            raise ConfigError("partition.difficulty_fraction: Algorithm 2 keeps class counts; the data has no classes")
        difficulty.apply(part, ds, cfg, cfg.seed)
    part.key = cfg.partition_key()
    part.content_hash = partition_hash(part, ds)
    return part


# ---------------------------------------------------------------------- persistence


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def partition_hash(p: Partition, ds: Dataset) -> str:
    h = hashlib.sha256()
    h.update(f"v{FORMAT_VERSION}".encode())
    h.update(ds.fingerprint().encode())
    for arrs in (p.train_idx, p.test_idx):
        for a in arrs:
            h.update(np.int64(len(a)).tobytes())
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(p.group, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(p.angle, dtype=np.float64).tobytes())
    if p.label_perm is not None:
        h.update(np.ascontiguousarray(p.label_perm, dtype=np.int64).tobytes())
    if len(p.server_idx):  # absent from the hash of partitions without a hold-out (unchanged hashes)
        h.update(b"server")
        h.update(np.ascontiguousarray(p.server_idx, dtype=np.int64).tobytes())
    return h.hexdigest()


def summary(p: Partition, ds: Dataset) -> dict:
    """The partition's JSON summary: sizes, groups, the scheme's ``info`` (super clusters, mix
    sources), and for classification data the label histograms and the heterogeneity measures
    (:mod:`flockfl.data.heterogeneity`, computed once and kept in ``p.info``)."""
    sizes = p.train_sizes()
    out = {
        "format_version": FORMAT_VERSION,
        "content_hash": p.content_hash,
        "key": p.key,
        "key_hash": key_hash(p.key),
        "dataset": ds.name,
        "num_clients": p.num_clients,
        "train_sizes": sizes.tolist(),
        "test_sizes": p.test_sizes().tolist(),
        "size_stats": {"min": int(sizes.min()), "max": int(sizes.max()), "mean": float(sizes.mean())},
        "groups": p.group.tolist(),
        "server_holdout": int(len(p.server_idx)),
    }
    out.update({k: v for k, v in p.info.items() if k != "heterogeneity"})
    if ds.task == "classification":
        y = ds.y_train
        hist = np.stack([np.bincount((p.label_perm[i] if p.label_perm is not None else np.arange(ds.num_classes))[y[idx]],
                                     minlength=ds.num_classes) for i, idx in enumerate(p.train_idx)])
        out["label_histograms"] = hist.tolist()
        prop = hist / np.maximum(hist.sum(1, keepdims=True), 1)
        glob = hist.sum(0) / max(hist.sum(), 1)
        # mean total-variation distance of client label distributions from the global one
        out["label_skew_tv"] = float(0.5 * np.abs(prop - glob).sum(1).mean())
        if "heterogeneity" not in p.info:  # computed once per partition object (a few seconds at most)
            from flockfl.data.heterogeneity import heterogeneity

            p.info["heterogeneity"] = heterogeneity(ds, p)
        out["heterogeneity"] = p.info["heterogeneity"]
    return out


def _pack(arrs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.cumsum([0] + [len(a) for a in arrs]).astype(np.int64)
    flat = np.concatenate(arrs).astype(np.int64) if arrs else np.zeros(0, np.int64)
    return flat, offsets


def _unpack(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def save_partition(p: Partition, ds: Dataset, path: Path) -> None:
    import io

    path.parent.mkdir(parents=True, exist_ok=True)
    tr, tr_off = _pack(p.train_idx)
    te, te_off = _pack(p.test_idx)
    meta = json.dumps(summary(p, ds), indent=1)  # first: it adds the heterogeneity measures to p.info
    arrays = dict(train_idx=tr, train_offsets=tr_off, test_idx=te, test_offsets=te_off, group=p.group, angle=p.angle,
                  key_json=np.array(json.dumps(p.key, sort_keys=True)), content_hash=np.array(p.content_hash),
                  server_idx=np.asarray(p.server_idx, np.int64), info_json=np.array(json.dumps(p.info, sort_keys=True)))
    if p.label_perm is not None:
        arrays["label_perm"] = p.label_perm
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, buf.getvalue())
    atomic_write(path.with_suffix(".json"), meta.encode())


def load_partition(path: Path) -> Partition:
    with np.load(path, allow_pickle=False) as z:
        return Partition(
            _unpack(z["train_idx"], z["train_offsets"]), _unpack(z["test_idx"], z["test_offsets"]),
            z["group"], z["angle"], z["label_perm"] if "label_perm" in z.files else None,
            json.loads(str(z["key_json"])), str(z["content_hash"]),
            z["server_idx"].astype(np.int64) if "server_idx" in z.files else np.zeros(0, np.int64),
            json.loads(str(z["info_json"])) if "info_json" in z.files else {},
        )


def partition_path(cfg: ExperimentConfig, root: str | Path = "data/partitions") -> Path:
    """``<root>/<name>.npz`` for a named partition, ``<root>/p-<hash>.npz`` otherwise.

    A named partition whose settings were overridden gets ``<name>-<hash>`` so that it
    never overwrites the partition DVC tracks under the plain name.
    """
    root = Path(root)
    kh = key_hash(cfg.partition_key())[:10]
    name = cfg.partition.name
    if not name:
        return root / f"p-{kh}.npz"
    plain = root / f"{name}.npz"
    meta = plain.with_suffix(".json")
    if meta.exists():
        try:
            if json.loads(meta.read_text()).get("key_hash", "")[:10] != kh:
                return root / f"{name}-{kh}.npz"
        except (json.JSONDecodeError, OSError):
            pass
    return plain


def build_or_load(ds: Dataset, cfg: ExperimentConfig, root: str | Path = "data/partitions",
                  build: bool = True) -> tuple[Partition, Path, bool]:
    """Return (partition, path, cached): load it when a file with the same settings and data
    exists, otherwise build and save it (``build=False``: refuse instead, e.g. on a Dask worker,
    which must train on the flow's partition and never write one)."""
    path = partition_path(cfg, root)
    if path.exists():
        try:
            p = load_partition(path)
            if key_hash(p.key) == key_hash(cfg.partition_key()) and partition_hash(p, ds) == p.content_hash:
                return p, path, True
        except Exception:  # a damaged file is rebuilt, never trusted
            pass
    if not build:
        raise ConfigError(f"partition: no valid partition file for these settings and this data at {path}; "
                          "point executor.data_root at the flow's partitions directory, with the same dataset files")
    p = make_partition(ds, cfg)
    save_partition(p, ds, path)
    return p, path, False
