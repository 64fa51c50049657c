"""Partition schemes: one function per scheme, all returning a :class:`Partition`.

A partition gives every client its train and test indices, its transform (a rotation, a
label permutation) and its ground-truth group where the scheme defines one. Each client's
test split follows its train distribution: a label-skewed client gets a test set with the
same class proportions. Partitions are deterministic given their config and seed, saved as
``data/partitions/<name>.npz`` plus a JSON summary, and addressed by content hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from flockfl.config import ConfigError, ExperimentConfig, PartitionConfig
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


def split_test_like_train(y_test: np.ndarray, hist: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Give every client test samples with its train class proportions.

    Each class's test indices are shuffled and cut in proportion to the clients' train
    counts of that class (largest-remainder rounding, so every sample is used once).
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
        counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
        for i, part in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            out[i].append(part)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in out]


def _check_sizes(n_train: int, cfg: PartitionConfig) -> None:
    if cfg.num_clients > n_train:
        raise ConfigError(
            f"partition.num_clients: {cfg.num_clients} clients but only {n_train} training samples; use fewer clients"
        )


# ---------------------------------------------------------------------- schemes


def partition_iid(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    _check_sizes(len(ds.y_train), cfg)
    rng = np_rng(seed, purpose="partition")
    train = _split_even(rng.permutation(len(ds.y_train)), cfg.num_clients)
    test = _split_even(rng.permutation(len(ds.y_test)), cfg.num_clients)
    n = cfg.num_clients
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_dirichlet(ds: Dataset, cfg: PartitionConfig, seed: int, min_size: int = 2, max_tries: int = 1000) -> Partition:
    """Per class c: q_c ~ Dir(α·1_N), and class c's samples are split among clients by q_c."""
    _check_sizes(len(ds.y_train), cfg)
    n = cfg.num_clients
    min_size = min(min_size, len(ds.y_train) // n)
    rng = np_rng(seed, purpose="partition")
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in range(ds.num_classes):
            idx = rng.permutation(np.flatnonzero(ds.y_train == c))
            q = rng.dirichlet(np.full(n, cfg.alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for i, p in enumerate(np.split(idx, cuts)):
                parts[i].append(p)
        train = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(t) for t in train) >= min_size:
            break
    else:
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
    n, s = cfg.num_clients, cfg.classes_per_client
    if n * s > len(ds.y_train):
        raise ConfigError(
            f"partition.classes_per_client: {n}×{s}={n * s} shards but only {len(ds.y_train)} training samples; "
            "lower num_clients or classes_per_client"
        )
    rng = np_rng(seed, purpose="partition")
    order = rng.permutation(len(ds.y_train))
    order = order[np.argsort(ds.y_train[order], kind="stable")]
    shards = np.array_split(order, n * s)
    deal = rng.permutation(n * s).reshape(n, s)
    train = [np.sort(np.concatenate([shards[j] for j in row])) for row in deal]
    hist = label_histogram(ds.y_train, train, ds.num_classes)
    test = split_test_like_train(ds.y_test, hist, rng)
    return Partition(train, test, -np.ones(n, np.int64), np.zeros(n), None, {})


def partition_rotated(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    """k groups of clients; group j sees its images rotated by 360/k·j degrees (IFCA §4.2)."""
    if ds.x_train.ndim != 4:
        raise ConfigError(f"partition.scheme: 'rotated' needs image data; {ds.name} samples have shape {ds.input_shape}")
    p = partition_iid(ds, cfg, seed)
    p.group = _contiguous_groups(cfg.num_clients, cfg.k).astype(np.int64)
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
    p.group = _contiguous_groups(cfg.num_clients, cfg.k).astype(np.int64)
    p.label_perm = label_swap_permutations(cfg.k, ds.num_classes, cfg.label_swap_mode, seed)[p.group]
    return p


def partition_natural(ds: Dataset, cfg: PartitionConfig, seed: int) -> Partition:
    if ds.client_train is None:
        raise ConfigError(f"partition.scheme: 'natural' needs client ids in the dataset; {ds.name} has none (use iid, dirichlet, ...)")
    ids = np.unique(ds.client_train)
    if len(ids) != cfg.num_clients or ids[0] != 0 or ids[-1] != len(ids) - 1:
        raise ConfigError(
            f"partition.num_clients: the dataset has {len(ids)} natural clients (ids 0..{len(ids) - 1} expected); "
            f"set partition.num_clients={len(ids)}"
        )
    train = [np.flatnonzero(ds.client_train == i) for i in ids]
    test = [np.flatnonzero(ds.client_test == i) for i in ids]
    group = ds.group if ds.group is not None else -np.ones(len(ids), np.int64)
    if len(group) != len(ids):
        raise ConfigError(f"dataset group: {len(group)} entries for {len(ids)} clients; give one group per client")
    return Partition(train, test, np.asarray(group, np.int64), np.zeros(len(ids)), None, {})


SCHEMES = {
    "iid": partition_iid,
    "dirichlet": partition_dirichlet,
    "shards": partition_shards,
    "rotated": partition_rotated,
    "label_swap": partition_label_swap,
    "natural": partition_natural,
}


def make_partition(ds: Dataset, cfg: ExperimentConfig) -> Partition:
    part = SCHEMES[cfg.partition.scheme](ds, cfg.partition, cfg.seed)
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
    return h.hexdigest()


def summary(p: Partition, ds: Dataset) -> dict:
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
    }
    if ds.task == "classification":
        y = ds.y_train
        hist = np.stack([np.bincount((p.label_perm[i] if p.label_perm is not None else np.arange(ds.num_classes))[y[idx]],
                                     minlength=ds.num_classes) for i, idx in enumerate(p.train_idx)])
        out["label_histograms"] = hist.tolist()
        prop = hist / np.maximum(hist.sum(1, keepdims=True), 1)
        glob = hist.sum(0) / max(hist.sum(), 1)
        # mean total-variation distance of client label distributions from the global one
        out["label_skew_tv"] = float(0.5 * np.abs(prop - glob).sum(1).mean())
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
    arrays = dict(train_idx=tr, train_offsets=tr_off, test_idx=te, test_offsets=te_off, group=p.group, angle=p.angle,
                  key_json=np.array(json.dumps(p.key, sort_keys=True)), content_hash=np.array(p.content_hash))
    if p.label_perm is not None:
        arrays["label_perm"] = p.label_perm
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, buf.getvalue())
    atomic_write(path.with_suffix(".json"), json.dumps(summary(p, ds), indent=1).encode())


def load_partition(path: Path) -> Partition:
    with np.load(path, allow_pickle=False) as z:
        return Partition(
            _unpack(z["train_idx"], z["train_offsets"]), _unpack(z["test_idx"], z["test_offsets"]),
            z["group"], z["angle"], z["label_perm"] if "label_perm" in z.files else None,
            json.loads(str(z["key_json"])), str(z["content_hash"]),
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


def build_or_load(ds: Dataset, cfg: ExperimentConfig, root: str | Path = "data/partitions") -> tuple[Partition, Path, bool]:
    """Return (partition, path, cached): load it when a file with the same settings and data
    exists, otherwise build and save it."""
    path = partition_path(cfg, root)
    if path.exists():
        try:
            p = load_partition(path)
            if key_hash(p.key) == key_hash(cfg.partition_key()) and partition_hash(p, ds) == p.content_hash:
                return p, path, True
        except Exception:  # a damaged file is rebuilt, never trusted
            pass
    p = make_partition(ds, cfg)
    save_partition(p, ds, path)
    return p, path, False
