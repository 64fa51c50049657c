"""The partition schemes by name (``partition.scheme``), the server's hold-out and
:func:`make_partition`, which runs the configured scheme."""

from __future__ import annotations

import dataclasses

import numpy as np

from flockfl.config import ExperimentConfig
from flockfl.data.dataset import Dataset
from flockfl.data.datasets import merge_splits
from flockfl.data.partition import Partition, largest_remainder, partition_hash, split_local
from flockfl.data.plain_schemes import (partition_dirichlet, partition_iid, partition_label_swap, partition_natural,
                                        partition_pfllib_pat, partition_rotated, partition_shards, partition_shards_pct)
from flockfl.data.superclusters import partition_mix, partition_sc_dir, partition_sc_niid
from flockfl.errors import ConfigError
from flockfl.plugins import Registry
from flockfl.rng import np_rng


def _check_scheme(name: str, fn: object) -> str:
    return "" if callable(fn) else f"{fn!r} is not a function (ds: Dataset, cfg: PartitionConfig, seed) -> Partition"


# the registry of ``partition.scheme``: the built-ins, then the plugins' (flockfl.plugins.register_scheme)
SCHEMES: Registry = Registry("scheme", {
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
    "pfllib_pat": partition_pfllib_pat,
}, check=_check_scheme)

# Docstrings of the built-in schemes whose functions (in flockfl.data.plain_schemes) have none; `flockfl list schemes`
# prints each one's first sentence. A docstring written on the function itself takes precedence.
_SCHEME_DOCS = {
    partition_iid: """An equal random share of the training and test sets for every client (IID).

    ``partition.client_sizes=uneven`` gives the training shares DIFCA's uneven sizes instead
    (:func:`~flockfl.data.partition.uneven_sizes`); there is no ground-truth group.""",
    partition_label_swap: """k groups of clients, each with its own fixed label permutation, over an IID split.

    The clients are dealt as by ``iid`` and grouped in k contiguous blocks; group 0 keeps the labels,
    group j ≥ 1 swaps labels 2(j−1) and 2(j−1)+1 (mod C) with ``label_swap_mode=pairs``, or applies a
    random permutation with ``random_perm``. The group is the ground truth. Classification data only.""",
    partition_natural: """The data's own clients: each sample goes to the client its id in the data names.

    The ids are the dataset's ``client_train`` / ``client_test`` (an npz file's, or a synthetic
    generator's devices), 0..n−1 with none missing; ``num_clients`` is n (another value is refused).
    The ground-truth group is the dataset's ``group``, one per client, when it has one.""",
}
for _fn, _doc in _SCHEME_DOCS.items():
    _fn.__doc__ = _fn.__doc__ or _doc
del _fn, _doc


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
    for the server (unset counts as 0 here: the config resolves it from the algorithm). With
    ``partition.test_split=local`` the scheme deals the pooled train and test sets (``ds`` is
    pooled in place) and each client's share is then split into its train and test samples,
    before any difficulty ordering (which orders training samples only)."""
    h = cfg.partition.server_holdout or 0
    scheme = SCHEMES[cfg.partition.scheme]
    local = cfg.partition.test_split == "local"
    if local:
        merge_splits(ds)
    if h > 0:
        held = server_holdout_indices(ds, h, cfg.seed)
        keep = np.setdiff1d(np.arange(len(ds.y_train)), held)
        part = scheme(_train_subset(ds, keep), cfg.partition, cfg.seed)
        part.train_idx = [keep[i].astype(np.int64) for i in part.train_idx]
        part.server_idx = held
    else:
        part = scheme(ds, cfg.partition, cfg.seed)
    if local:  # the scheme's own test split is replaced by each client's share of its own samples
        part.train_idx, part.test_idx = split_local(part.train_idx, cfg.partition.local_test_fraction, cfg.seed)
        part.info["merged_splits"] = ds.meta["merged_splits"]
    if cfg.partition.difficulty_fraction is not None:  # Algorithm 2: same class counts, controlled difficulty
        from flockfl.data import difficulty

        if ds.task != "classification":
            raise ConfigError("partition.difficulty_fraction: Algorithm 2 keeps class counts; the data has no classes")
        difficulty.apply(part, ds, cfg, cfg.seed)
    part.key = cfg.partition_key()
    part.content_hash = partition_hash(part, ds)
    return part
