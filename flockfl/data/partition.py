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

Here: :class:`Partition`, the shared splitting helpers and the plain schemes; the
super-cluster and mix schemes are in :mod:`flockfl.data.superclusters`, the registry, the
server hold-out and ``make_partition`` in :mod:`flockfl.data.schemes`, and files (npz + JSON
summary, the content-addressed cache) in :mod:`flockfl.data.store`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from flockfl.config import PartitionConfig
from flockfl.data.datasets import Dataset
from flockfl.errors import ConfigError
from flockfl.rng import np_rng

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


# ---------------------------------------------------------------------- content address

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
