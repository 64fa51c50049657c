"""The partition store: a partition is written by a DVC stage (or on first use) to
``data/partitions/<name>.npz`` plus a JSON summary, and addressed by the hash of its settings
and content, so a run loads the file whose settings and data match and rebuilds otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flockfl.config import GENERATOR_KEYS, ExperimentConfig
from flockfl.data.dataset import Dataset
from flockfl.data.datasets import load_dataset, merge_splits
from flockfl.data.partition import FORMAT_VERSION, Partition, key_hash, partition_hash
from flockfl.data.schemes import make_partition
from flockfl.errors import ConfigError
from flockfl.files import atomic_write


def generator_choices(key: dict) -> dict:
    """The scheme and the generator choices that shaped a partition (its Dirichlet rule and
    minimum size, rotated mode, shard size: ``GENERATOR_KEYS``, as the key records them), plus
    the input normalisation when there is one."""
    part = key.get("partition", {})
    out = {"scheme": part.get("scheme"), **{k: part[k] for k in GENERATOR_KEYS if k in part}}
    if "normalize" in key.get("dataset", {}):
        out["normalize"] = key["dataset"]["normalize"]
    return out


def summary(p: Partition, ds: Dataset) -> dict:
    """The partition's JSON summary: sizes, groups, the generator choices (``generator``), the
    scheme's ``info`` (super clusters, mix sources), and for classification data the label
    histograms and the heterogeneity measures (:mod:`flockfl.data.heterogeneity`, computed once
    and kept in ``p.info``)."""
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
        "generator": generator_choices(p.key),
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
    which must train on the flow's partition and never write one). With
    ``partition.test_split=local``, ``ds`` is pooled in place first (its train and test sets
    become one array: :func:`~flockfl.data.datasets.merge_splits`), since the partition's indices
    point into the pool and the caller builds the client data from this same ``ds``."""
    if cfg.partition.test_split == "local":
        merge_splits(ds)
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


def build_partition(cfg: ExperimentConfig, root: str | Path = "data/partitions") -> tuple[Dataset, Partition, Path, bool]:
    """Load the data and build (or find) the partition: (dataset, partition, path, cached).
    ``flockfl run`` calls it before the flow starts, so that a missing dataset or an impossible
    partition is one line, not a failed flow; the flow's partition task then loads the file."""
    ds = load_dataset(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    return (ds, *build_or_load(ds, cfg, root))
