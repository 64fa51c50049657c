"""Partitions: the :class:`Partition` every scheme returns, and the machinery the schemes share.

A partition gives every client its train and test indices, its transform (a rotation, a
label permutation) and its ground-truth group where the scheme defines one. Each client's
test split follows its train distribution: a label-skewed client gets a test set with the
same class proportions. Partitions are deterministic given their config and seed, saved as
``data/partitions/<name>.npz`` plus a JSON summary, and addressed by content hash.

Schemes: ``iid``, ``dirichlet`` (C-Dir(α), NIID-Bench's "noniid-labeldir"), ``shards``
(McMahan's pathological shards, or Sub-FedAvg's with ``shard_size``), ``shards_pct``
(C-NIID(ρ%), NIID-Bench's "noniid-#label": #C=k is ρ = 100·k/C), ``pfllib_pat`` (PFLlib's
pathological split), ``rotated`` (IFCA's protocol, or disjoint groups), ``label_swap``,
``natural``, ``sc_niid`` / ``sc_dir`` (super-cluster partitions, thesis §5.2, spec
``flis-pacfl-scniid.md`` §3.1–3.3) and ``mix`` (one source per client, MIX-4, §3.5).

With ``partition.test_split=local`` (PFLlib) the test split is not the scheme's: the dataset's
train and test sets are pooled first (:func:`~flockfl.data.datasets.merge_splits`), the scheme
deals the pool, and :func:`split_local` then splits each client's own samples.

Here: :class:`Partition`, the shared splitting helpers (test sets like the train sets, the
Dirichlet and shard deals, client sizes, the checks) and the content address; the plain
schemes are in :mod:`flockfl.data.plain_schemes`, the super-cluster and mix schemes in
:mod:`flockfl.data.superclusters`, the registry, the server hold-out and ``make_partition`` in
:mod:`flockfl.data.schemes`, and files (npz + JSON summary, the content-addressed cache) in
:mod:`flockfl.data.store`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from flockfl.config import PartitionConfig
from flockfl.data.dataset import Dataset
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
                     min_size: int, max_tries: int, balance: bool = False) -> Optional[list[np.ndarray]]:
    """Per class c (in order): its samples shuffled, q_c ~ Dir(α·1_n), and the samples cut among
    the n clients by q_c; the whole split redrawn until every client has ``min_size`` samples
    (None after ``max_tries`` draws). ``balance`` is NIID-Bench's rule: before class c is cut,
    q_{c,j} is zeroed for every client j already holding N/n samples or more (N: the samples of
    ``classes``) and q_c renormalised, so no client grows far past an equal share."""
    total = int(np.isin(y, classes).sum())
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        held = np.zeros(n, np.int64)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            q = rng.dirichlet(np.full(n, alpha))
            open_ = held < total / n
            if balance and open_.any():  # (none open only once every sample is dealt: an empty class)
                q = q * open_
                q = q / q.sum()
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for i, p in enumerate(np.split(idx, cuts)):
                parts[i].append(p)
                held[i] += len(p)
        train = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(t) for t in train) >= min_size:
            return train
    return None


# NIID-Bench redraws until the minimum size holds, without limit; flockfl stops with a one-line error after
# this many draws (Fashion-MNIST, 100 clients, Dir(0.05): ~4,000 draws of ~3 ms; 20,000 take about a minute)
MAX_DIRICHLET_DRAWS = 20_000


def dirichlet_split(y: np.ndarray, classes: np.ndarray, n: int, cfg: PartitionConfig, rng: np.random.Generator,
                    where: str = "", max_tries: int = MAX_DIRICHLET_DRAWS) -> list[np.ndarray]:
    """``classes``' samples split among n clients by the configured Dirichlet rule
    (``partition.dirichlet_rule``: NIID-Bench's balancing or none) and minimum size
    (``partition.min_size``; when unset, the rule's own, lowered to what the data allows);
    a one-line ConfigError when the minimum exceeds an equal share, or when no draw of
    ``max_tries`` reaches it (``where`` names the part of the data, e.g. a super cluster)."""
    available = int(np.isin(y, classes).sum()) // n
    if cfg.min_size is not None and cfg.min_size > available:
        raise ConfigError(f"partition.min_size: {cfg.min_size} samples for each of {n} clients, but an equal share{where} "
                          f"is {available}; set min_size to at most {available} or lower num_clients")
    min_size = cfg.resolved_min_size() if cfg.min_size is not None else min(cfg.resolved_min_size(), available)
    train = _dirichlet_split(y, classes, n, cfg.alpha, rng, min_size, max_tries, balance=cfg.dirichlet_rule == "niid_bench")
    if train is None:
        raise ConfigError(f"partition.alpha: Dirichlet({cfg.alpha}) ({cfg.dirichlet_rule} rule) left a client{where} with "
                          f"under {min_size} samples after {max_tries} draws; lower partition.min_size, raise alpha or "
                          "lower num_clients")
    return train


def _shard_deal(y: np.ndarray, idx: np.ndarray, n: int, s: int, rng: np.random.Generator,
                shard_size: Optional[int] = None) -> list[np.ndarray]:
    """Sort ``idx`` by label (a random order within a label), cut it into n·s shards and deal s
    random shards to each of n clients (McMahan et al.). With ``shard_size`` (Sub-FedAvg's 250),
    the shards are cut from a random n·s·shard_size of the samples, each exactly that size."""
    order = rng.permutation(idx)
    if shard_size is not None:
        order = order[: n * s * shard_size]
    order = order[np.argsort(y[order], kind="stable")]
    shards = np.array_split(order, n * s)
    deal = rng.permutation(n * s).reshape(n, s)
    return [np.sort(np.concatenate([shards[j] for j in row])) for row in deal]


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


def check_shards(n: int, s: int, shard_size: Optional[int], available: int, where: str) -> None:
    """A one-line ConfigError when n clients × s shards (of ``shard_size`` samples, or at least 1)
    need more than the ``available`` training samples (``where``: e.g. " of super cluster 1")."""
    if shard_size is None and n * s > available:
        raise ConfigError(f"partition.classes_per_client: {n}×{s}={n * s} shards but only {available} training "
                          f"samples{where}; lower num_clients or classes_per_client")
    if shard_size is not None and n * s * shard_size > available:
        raise ConfigError(f"partition.shard_size: {n}×{s} shards of {shard_size} need {n * s * shard_size} samples but "
                          f"only {available} training samples{where}; lower shard_size, num_clients or classes_per_client")


def split_local(own: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``partition.test_split=local``: each client's own samples split at random into train and
    test, as PFLlib's ``train_test_split(train_size=1 − f, shuffle=True)`` (not stratified):
    client i's n_i samples in a random order from the (seed, i, "partition/local_test") stream,
    the first n_i − ⌊(1 − f)·n_i⌋ its test set, the rest its training set (both sorted); a client
    left with an empty side is a one-line ConfigError."""
    train, test = [], []
    for i, idx in enumerate(own):
        perm = np_rng(seed, client=i, purpose="partition/local_test").permutation(np.asarray(idx, np.int64))
        n_test = len(perm) - int(np.floor((1.0 - fraction) * len(perm)))
        if n_test == 0 or n_test == len(perm):
            raise ConfigError(f"partition.local_test_fraction: client {i} has {len(perm)} sample(s), too few to split "
                              f"{fraction:g} of them into a test set and keep the rest for training; use fewer clients")
        test.append(np.sort(perm[:n_test]))
        train.append(np.sort(perm[n_test:]))
    return train, test


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
