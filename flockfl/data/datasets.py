"""The datasets by name (``dataset.name``): the registry of loaders, each returning a
:class:`~flockfl.data.dataset.Dataset`, and :func:`load_dataset`, which runs the configured one.

- ``digits``: scikit-learn's bundled 8×8 digits (offline default);
- ``fashion_mnist`` / ``mnist``: IDX or IDX.gz files (searched in ``dataset.path``, then
  ``data/raw/<name>/``, then the Debian package's folder);
- ``npz``: a user's own arrays, optionally with natural client ids and ground-truth groups;
- ``synthetic_linreg``: IFCA's mixture of linear regressions (spec §4.1);
- ``synthetic_fedprox``: FedProx's Synthetic(α, β), one natural client per device (flexcfl.md §7);
- ``mix``: several of the above side by side, each with its own 10 labels (MIX-4, thesis §3.4.2).

The loaders are in :mod:`flockfl.data.images` (digits, IDX, mix), :mod:`flockfl.data.npz` and
:mod:`flockfl.data.synthetic`. ``dataset.normalize=per_channel`` standardises the images of any
of them as they are loaded (:func:`standardise_channels`); ``partition.test_split=local`` pools
the train and test sets into one (:func:`merge_splits`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import numpy as np

from flockfl.config import DatasetConfig
from flockfl.data.dataset import Dataset
from flockfl.data.images import load_digits, load_fashion_mnist, load_mix, load_mnist
from flockfl.data.npz import load_npz
from flockfl.data.synthetic import make_synthetic_fedprox, make_synthetic_linreg
from flockfl.errors import ConfigError
from flockfl.plugins import Registry


NATURAL_ONLY = ("synthetic_fedprox",)  # datasets whose clients are the generator's devices


def check_natural_only(dataset: str, scheme: str) -> None:
    """ValueError (one line) when a dataset whose clients are its devices is re-partitioned:
    Synthetic(α, β)'s heterogeneity *is* its per-device models, and pooling the devices to deal
    them out again (iid, dirichlet, ...) would throw that away."""
    if dataset in NATURAL_ONLY and scheme != "natural":
        raise ValueError(f"partition.scheme: {dataset} is generated device by device (each device is a client); "
                         f"use partition.scheme=natural, not {scheme!r}")


def _check_loader(name: str, fn: object) -> str:
    return "" if callable(fn) else f"{fn!r} is not a function (cfg: DatasetConfig, seed, num_clients) -> Dataset"


# the registry of ``dataset.name`` (the schema's list is checked against its built-ins by the tests), then the
# plugins' (flockfl.plugins.register_dataset)
LOADERS: Registry = Registry("dataset", {
    "digits": load_digits,
    "fashion_mnist": load_fashion_mnist,
    "mnist": load_mnist,
    "npz": load_npz,
    "synthetic_linreg": make_synthetic_linreg,
    "mix": load_mix,
    "synthetic_fedprox": make_synthetic_fedprox,
}, check=_check_loader)


def load_dataset(cfg: DatasetConfig, seed: int, num_clients: Optional[int]) -> Dataset:
    """The configured dataset. A built-in one is loaded once per process for the same settings
    and files (``flockfl run`` checks the partition before its flow, whose first task loads the
    data again; a sweep's cells share it): the last one loaded is kept, and each caller gets its
    own Dataset over the same arrays. Nothing writes into a Dataset's arrays; a caller may
    replace them on its own copy (:func:`merge_splits` pools the splits in place)."""
    key = _memo_key(cfg, seed, num_clients)
    if key is None or key not in _LAST:
        ds = LOADERS[cfg.name](cfg, seed, num_clients)
        ds = standardise_channels(ds, cfg) if cfg.normalize == "per_channel" else ds
        if key is None:
            return ds
        _LAST.clear()
        _LAST[key] = ds
    kept = _LAST[key]
    return dataclasses.replace(kept, meta=dict(kept.meta))


_LAST: dict = {}  # the last built-in dataset loaded in this process, by _memo_key


def _memo_key(cfg: DatasetConfig, seed: int, num_clients: Optional[int]) -> Optional[tuple]:
    """The settings, the working folder (a relative ``dataset.path`` and the IDX loaders'
    ``data/raw/<name>/`` are read from it) and the files' (size, mtime) a load depends on; None
    for a plugin's dataset (its loader may read anything) or a path that cannot be read (the
    loader says why)."""
    if cfg.name not in LOADERS.builtins():
        return None
    files: list = []
    if cfg.path:
        try:
            root = Path(cfg.path)
            for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
                st = f.stat()
                if f.is_file():
                    files.append((str(f), st.st_size, st.st_mtime_ns))
        except OSError:
            return None
    return cfg.model_dump_json(), seed, num_clients, os.getcwd(), tuple(files)


def standardise_channels(ds: Dataset, cfg: DatasetConfig) -> Dataset:
    """``dataset.normalize=per_channel``: x ← (x − mean_c)/std_c on the train and test images,
    channel by channel, before any partition or client sees them (torchvision's ``Normalize``
    once, for the whole run). The statistics are ``normalize_mean`` / ``normalize_std`` when
    given, else the training images' own (float64 mean and population std; a constant channel
    keeps std 1); they are kept in ``meta['normalize']``."""
    if ds.x_train.ndim != 4:
        raise ConfigError(f"dataset.normalize: per_channel standardises image channels; {ds.name} samples have shape "
                          f"{ds.input_shape}; use dataset.normalize=none")
    channels = ds.x_train.shape[1]
    if cfg.normalize_mean is not None:
        if len(cfg.normalize_mean) != channels:
            raise ConfigError(f"dataset.normalize_mean: {len(cfg.normalize_mean)} values for {channels}-channel images; "
                              f"give {channels} values (and as many in normalize_std)")
        mean, std = np.asarray(cfg.normalize_mean, np.float64), np.asarray(cfg.normalize_std, np.float64)
    else:
        mean = ds.x_train.mean(axis=(0, 2, 3), dtype=np.float64)
        std = ds.x_train.std(axis=(0, 2, 3), dtype=np.float64)
        std = np.where(std > 0, std, 1.0)
    m32, s32 = mean.astype(np.float32).reshape(1, -1, 1, 1), std.astype(np.float32).reshape(1, -1, 1, 1)
    scale = lambda x: ((x - m32) / s32).astype(np.float32)  # noqa: E731
    return dataclasses.replace(ds, x_train=scale(ds.x_train), x_test=scale(ds.x_test),
                               meta={**ds.meta, "normalize": {"mean": mean.tolist(), "std": std.tolist()}})


def merge_splits(ds: Dataset) -> Dataset:
    """``partition.test_split=local`` (PFLlib): the train and test sets pooled, the train samples
    first, so that a partition deals the union over the clients and splits each client's own
    samples. ``x_train`` and ``x_test`` (and the labels, natural client ids and mix sources) are
    then one and the same array, so a partition's train and test indices both point into it.

    In place, and once (``meta['merged_splits']`` records the sizes it pooled): the run builds its
    partition and its client data from the same loaded object (``flockfl.preparation.prepare``)."""
    if "merged_splits" in ds.meta:
        return ds
    cat = lambda a, b: None if a is None else np.concatenate([a, b])  # noqa: E731
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    ds.x_train = ds.x_test = cat(ds.x_train, ds.x_test)
    ds.y_train = ds.y_test = cat(ds.y_train, ds.y_test)
    if ds.client_train is not None:
        ds.client_train = ds.client_test = cat(ds.client_train, ds.client_test)
    if ds.source_train is not None:
        ds.source_train = ds.source_test = cat(ds.source_train, ds.source_test)
    ds.meta = {**ds.meta, "merged_splits": {"train": n_train, "test": n_test}}
    return ds
