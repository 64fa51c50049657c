"""The papers' partition generators, models and input normalisation, each selectable: NIID-Bench's
Dirichlet rule, NIID-Bench's #C=k label skew, IFCA's rotated protocol, Sub-FedAvg's shard size,
LeNet-5 as thesis Table 3.17, per-channel normalisation; every generator choice recorded in the
partition's content address and JSON, so a cached partition is never reused for another."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flockfl.config import DatasetConfig, PartitionConfig
from flockfl.data.dataset import Dataset
from flockfl.data.datasets import load_dataset
from flockfl.data.partition import dirichlet_split, label_histogram
from flockfl.data.schemes import make_partition
from flockfl.data.store import build_or_load, load_partition, partition_path, save_partition
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rng import np_rng

from conftest import tiny_config


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(DatasetConfig(name="digits"), 3, None)


def cfg_of(**partition):
    return validate(tiny_config(partition=partition, train={"clients_per_round": 1}))


def label_sized(n: int, classes: int = 10, seed: int = 0) -> Dataset:
    """A dataset of ``n`` training labels (in random order, equal classes) with 1-pixel images:
    the partition schemes read only the labels, so MNIST-size cases cost nothing."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % classes).astype(np.int64)
    yt = np.arange(n // 6) % classes
    return Dataset("labels", np.zeros((n, 1, 1, 1), np.float32), y, np.zeros((len(yt), 1, 1, 1), np.float32), yt,
                   num_classes=classes)


# ---------------------------------------------------------------------- NIID-Bench's Dirichlet rule


def niid_bench_labeldir(y: np.ndarray, n_parties: int, beta: float, rng: np.random.Generator, min_require_size: int = 10):
    """NIID-Bench's "noniid-labeldir" (Xtra-Computing/NIID-Bench utils.partition_data), written
    as its code reads, drawing from ``rng`` in its order (shuffle, then Dirichlet, class by class)."""
    min_size, N, K = 0, len(y), int(y.max()) + 1
    while min_size < min_require_size:
        idx_batch = [[] for _ in range(n_parties)]
        for k in range(K):
            idx_k = rng.permutation(np.where(y == k)[0])
            proportions = rng.dirichlet(np.repeat(beta, n_parties))
            proportions = np.array([p * (len(idx_j) < N / n_parties) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min(len(idx_j) for idx_j in idx_batch)
    return [np.sort(np.array(b, np.int64)) for b in idx_batch]


@pytest.mark.parametrize("n,alpha", [(10, 0.5), (20, 0.1), (30, 0.1)])
def test_dirichlet_is_niid_bench_by_default(digits, n, alpha):
    cfg = cfg_of(scheme="dirichlet", num_clients=n, alpha=alpha)
    assert cfg.partition.dirichlet_rule == "niid_bench" and cfg.partition.resolved_min_size() == 10
    part = make_partition(digits, cfg)
    expected = niid_bench_labeldir(digits.y_train, n, alpha, np_rng(cfg.seed, purpose="partition"))
    for got, want in zip(part.train_idx, expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,alpha", [(20, 0.1), (30, 0.1), (10, 0.1)])
def test_niid_bench_balancing_and_minimum_size(digits, n, alpha):
    """Class by class (in label order), a client that already holds N/n samples or more gets
    nothing of the next classes; every client ends with at least 10. flockfl's earlier rule,
    the same draws without either, breaks both on these settings."""
    def violations(part):
        hist = label_histogram(digits.y_train, part.train_idx, digits.num_classes)
        before = np.cumsum(hist, axis=1) - hist  # samples held before each class was dealt
        return int(((before >= len(digits.y_train) / n) & (hist > 0)).sum())

    new = make_partition(digits, cfg_of(scheme="dirichlet", num_clients=n, alpha=alpha))
    assert violations(new) == 0 and new.train_sizes().min() >= 10
    old = make_partition(digits, cfg_of(scheme="dirichlet", num_clients=n, alpha=alpha, dirichlet_rule="flockfl"))
    assert violations(old) > 0 and old.train_sizes().min() < 10
    assert sorted(np.concatenate(new.train_idx).tolist()) == list(range(len(digits.y_train)))  # every sample, once


def test_min_size_is_configurable_and_sc_dir_follows_the_rule(digits):
    part = make_partition(digits, cfg_of(scheme="dirichlet", num_clients=20, alpha=0.1, min_size=30))
    assert part.train_sizes().min() >= 30
    with pytest.raises(ConfigError, match=r"^partition\.min_size: 200 samples for each of 20 clients.*at most 71"):
        make_partition(digits, cfg_of(scheme="dirichlet", num_clients=20, alpha=0.1, min_size=200))
    with pytest.raises(ConfigError, match=r"^partition\.alpha: .*under 60 samples after 5 draws; lower partition\.min_size"):
        dirichlet_split(digits.y_train, np.arange(10), 20, cfg_of(scheme="dirichlet", num_clients=20, alpha=0.1,
                                                                  min_size=60).partition, np_rng(0), max_tries=5)
    sc = make_partition(digits, cfg_of(scheme="sc_dir", num_clients=20, alpha=0.1))
    assert sc.train_sizes().min() >= 10
    assert make_partition(digits, cfg_of(scheme="sc_dir", num_clients=20, alpha=0.1, dirichlet_rule="flockfl")
                          ).train_sizes().min() < 10


# ---------------------------------------------------------------------- NIID-Bench's #C=k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_label_k_is_shards_pct_with_rho_10k(digits, k):
    """NIID-Bench's "noniid-#label{k}" (#C=k): client i holds label i mod 10 and k − 1 other
    distinct labels, each label's samples split evenly among its holders, all of them used."""
    n = 10
    part = make_partition(digits, cfg_of(scheme="shards_pct", num_clients=n, rho=10 * k))
    hist = label_histogram(digits.y_train, part.train_idx, digits.num_classes)
    assert ((hist > 0).sum(1) == k).all()
    assert all(hist[i, i % 10] > 0 for i in range(n))
    for c in range(10):
        held = hist[:, c][hist[:, c] > 0]
        assert held.sum() in (0, (digits.y_train == c).sum())
        assert len(held) == 0 or held.max() - held.min() <= 1


# ---------------------------------------------------------------------- IFCA's rotated protocol


def test_rotated_gives_every_group_the_whole_data_set(digits):
    """IFCA's code: per group a fresh permutation of the whole training set, m_j clients × n
    samples, no sample twice within a group; every group's clients share the whole test set."""
    n_train, n_test = len(digits.y_train), len(digits.y_test)
    assert PartitionConfig().rotated_mode == "ifca"  # the default: IFCA's protocol
    part = make_partition(digits, cfg_of(scheme="rotated", num_clients=12, k=4, samples_per_client=100, rotated_mode="ifca"))
    np.testing.assert_array_equal(part.group, np.repeat(np.arange(4), 3))
    np.testing.assert_array_equal(part.angle, np.repeat([0.0, 90.0, 180.0, 270.0], 3))
    assert (part.train_sizes() == 100).all()
    groups = [np.concatenate([part.train_idx[i] for i in np.flatnonzero(part.group == j)]) for j in range(4)]
    for j, idx in enumerate(groups):
        assert len(np.unique(idx)) == 3 * 100  # m·n distinct samples of the whole set
        test = np.concatenate([part.test_idx[i] for i in np.flatnonzero(part.group == j)])
        np.testing.assert_array_equal(np.sort(test), np.arange(n_test))
    assert len(np.intersect1d(groups[0], groups[1])) > 0  # the groups see the same images, rotated differently
    # n unset: the whole training set in every group (⌊N/m⌋ each; N mod m samples left over)
    whole = make_partition(digits, cfg_of(scheme="rotated", num_clients=12, k=4, rotated_mode="ifca"))
    for j in range(4):
        idx = np.concatenate([whole.train_idx[i] for i in np.flatnonzero(whole.group == j)])
        assert len(np.unique(idx)) == len(idx) == 3 * (n_train // 3)
    with pytest.raises(ConfigError, match="partition.samples_per_client"):
        make_partition(digits, cfg_of(scheme="rotated", num_clients=12, k=4, samples_per_client=600, rotated_mode="ifca"))


def test_rotated_disjoint_and_uneven(digits):
    old = make_partition(digits, cfg_of(scheme="rotated", num_clients=12, k=2, rotated_mode="disjoint"))
    flat = np.concatenate(old.train_idx)
    assert len(np.unique(flat)) == len(flat) == len(digits.y_train)  # one split of the data over all clients
    uneven = make_partition(digits, cfg_of(scheme="rotated", num_clients=12, k=2, client_sizes="uneven", rotated_mode="ifca"))
    for j in range(2):  # DIFCA's sizes inside each group, summing to the group's m·n
        sizes = uneven.train_sizes()[uneven.group == j]
        assert sizes.sum() == 6 * (len(digits.y_train) // 6) and len(set(sizes.tolist())) > 1


# ---------------------------------------------------------------------- shard size


def test_sub_fedavg_shards_of_250_and_mcmahans_300():
    ds = label_sized(60_000)  # MNIST-size labels
    sub = make_partition(ds, cfg_of(scheme="shards", num_clients=100, classes_per_client=2, shard_size=250))
    assert (sub.train_sizes() == 500).all()
    flat = np.concatenate(sub.train_idx)
    assert len(np.unique(flat)) == 50_000  # 100 × 2 shards of 250 distinct samples
    hist = label_histogram(ds.y_train, sub.train_idx, 10)
    assert ((hist > 0).sum(1) <= 4).all() and ((hist > 0).sum(1) <= 2).mean() > 0.9  # label-sorted shards
    mcmahan = make_partition(ds, cfg_of(scheme="shards", num_clients=100, classes_per_client=2))
    assert (mcmahan.train_sizes() == 600).all()  # the data cut into n·s = 200 shards of 300
    with pytest.raises(ConfigError, match="^partition.shard_size: 100×2 shards of 400 need 80000"):
        make_partition(ds, cfg_of(scheme="shards", num_clients=100, classes_per_client=2, shard_size=400))


def test_sc_niid_takes_the_shard_size(digits):
    part = make_partition(digits, cfg_of(scheme="sc_niid", num_clients=10, shard_size=30))
    assert (part.train_sizes() == 60).all()


# ---------------------------------------------------------------------- the content address and the JSON


def test_generator_choices_are_recorded_for_their_schemes_only():
    key = lambda **p: cfg_of(**p).partition_key()  # noqa: E731
    assert {"dirichlet_rule": "niid_bench", "min_size": 10}.items() <= key(scheme="dirichlet")["partition"].items()
    assert key(scheme="dirichlet", dirichlet_rule="flockfl")["partition"]["min_size"] == 2
    assert key(scheme="rotated", k=2, rotated_mode="ifca")["partition"]["rotated_mode"] == "ifca"
    assert key(scheme="rotated", k=2, rotated_mode="disjoint")["partition"]["rotated_mode"] == "disjoint"
    assert PartitionConfig(scheme="rotated").generator() == {"rotated_mode": "ifca"}  # the default, resolved
    assert key(scheme="shards")["partition"]["shard_size"] is None
    iid = key(scheme="iid")
    assert not {"dirichlet_rule", "min_size", "rotated_mode", "shard_size"} & set(iid["partition"])
    assert "normalize" not in iid["dataset"]  # off: the keys of earlier partitions stay as they were
    normalised = validate(tiny_config(dataset={"normalize": "per_channel"})).partition_key()
    assert normalised["dataset"]["normalize"] == "per_channel"
    # a difficulty expert whose architecture changed under its name (lenet5: Table 3.17 now) gets a new address
    expert = lambda m: key(scheme="iid", difficulty_fraction=0.5, difficulty_model=m)["partition"]  # noqa: E731
    assert expert("lenet5")["difficulty_model_revision"] == "table_3_17"
    assert "difficulty_model_revision" not in expert("mclr")


def test_a_partition_cached_under_another_rule_is_never_reused(digits, tmp_path):
    """Built with the old rule (flockfl's, the default before), then the default changes: the
    new default's partition is built afresh, never the cached one; the JSON names the rule."""
    named = dict(scheme="dirichlet", num_clients=12, alpha=0.3, name="mine")
    old_cfg = cfg_of(**named, dirichlet_rule="flockfl")
    old, old_path, cached = build_or_load(digits, old_cfg, tmp_path)
    assert not cached
    meta = json.loads(old_path.with_suffix(".json").read_text())
    assert meta["generator"] == {"scheme": "dirichlet", "dirichlet_rule": "flockfl", "min_size": 2}
    assert build_or_load(digits, old_cfg, tmp_path)[2]  # the same settings: the cache

    new_cfg = cfg_of(**named)  # the default rule now: niid_bench
    new, new_path, cached = build_or_load(digits, new_cfg, tmp_path)
    assert not cached and new_path != old_path and new.content_hash != old.content_hash
    assert json.loads(new_path.with_suffix(".json").read_text())["generator"]["dirichlet_rule"] == "niid_bench"
    assert load_partition(old_path).content_hash == old.content_hash  # the old file is left alone

    # a file written before the rule was recorded (its key lacks the generator choices) is rebuilt too
    legacy = old_cfg.partition_key()
    for k in ("dirichlet_rule", "min_size"):
        legacy["partition"].pop(k)
    old.key = legacy
    plain = partition_path(cfg_of(scheme="dirichlet", num_clients=12, alpha=0.3), tmp_path)
    save_partition(old, digits, plain)
    p, path, cached = build_or_load(digits, cfg_of(scheme="dirichlet", num_clients=12, alpha=0.3, dirichlet_rule="flockfl"),
                                    tmp_path)
    assert not cached and p.key["partition"]["dirichlet_rule"] == "flockfl"
    # a rotated partition of the disjoint rule is not IFCA's either
    disjoint = cfg_of(scheme="rotated", num_clients=12, k=2, rotated_mode="disjoint", name="rot")
    build_or_load(digits, disjoint, tmp_path)
    assert not build_or_load(digits, cfg_of(scheme="rotated", num_clients=12, k=2, rotated_mode="ifca", name="rot"),
                             tmp_path)[2]


# ---------------------------------------------------------------------- models and normalisation


def test_lenet5_is_table_3_17_and_the_padded_variant_keeps_400():
    import torch

    from models import build_model

    thesis, padded = build_model("lenet5", (1, 28, 28), 10), build_model("lenet5_padded", (1, 28, 28), 10)
    assert thesis[7].in_features == 256 and padded[7].in_features == 400
    assert thesis[0].padding == (0, 0) and padded[0].padding == (2, 2)
    # conv 156 + 2416, FC 256·120+120, 120·84+84, 84·10+10
    assert sum(p.numel() for p in thesis.parameters()) == 156 + 2416 + 30840 + 10164 + 850
    assert build_model("lenet5", (3, 32, 32), 10)[7].in_features == 400  # CIFAR-10: Table 3.17's 400
    assert thesis(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    small = [tuple(p.shape) for p in build_model("lenet5", (1, 8, 8), 10).parameters()]
    assert small == [tuple(p.shape) for p in build_model("lenet5_padded", (1, 8, 8), 10).parameters()]


def test_per_channel_normalisation(digits):
    ds = load_dataset(DatasetConfig(name="digits", normalize="per_channel"), 3, None)
    mean, std = ds.x_train.mean(axis=(0, 2, 3), dtype=np.float64), ds.x_train.std(axis=(0, 2, 3), dtype=np.float64)
    np.testing.assert_allclose(mean, 0, atol=1e-6)
    np.testing.assert_allclose(std, 1, atol=1e-5)
    raw_mean, raw_std = ds.meta["normalize"]["mean"][0], ds.meta["normalize"]["std"][0]
    np.testing.assert_allclose(ds.x_test, (digits.x_test - raw_mean) / raw_std, atol=1e-6)  # the train statistics
    np.testing.assert_array_equal(ds.y_train, digits.y_train)
    given = load_dataset(DatasetConfig(name="digits", normalize="per_channel", normalize_mean=[0.1307],
                                       normalize_std=[0.3081]), 3, None)
    np.testing.assert_allclose(given.x_train, (digits.x_train - 0.1307) / 0.3081, atol=1e-6)
    with pytest.raises(ConfigError, match="^dataset.normalize_mean: 2 values for 1-channel"):
        load_dataset(DatasetConfig(name="digits", normalize="per_channel", normalize_mean=[0.1, 0.2],
                                   normalize_std=[0.3, 0.3]), 3, None)
    part_raw, part_norm = (make_partition(d, cfg_of(scheme="iid")) for d in (digits, ds))
    assert part_raw.content_hash != part_norm.content_hash  # the data differ, so does the address


def test_a_normalised_run_trains_on_normalised_clients(tmp_path):
    """The clients' data is the normalised data (iid: the whole training set, mean 0, std 1), and a
    run with weight decay and momentum learns on it."""
    import torch

    from flockfl.rounds import prepare, run_rounds

    cfg = validate(tiny_config(dataset={"normalize": "per_channel"}, partition={"scheme": "iid"},
                               train={"rounds": 3, "weight_decay": 1e-4, "momentum": 0.5}))
    prep = prepare(cfg, tmp_path)
    x = prep.ctx.data.train.x.double()
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(unbiased=False)) - 1) < 1e-5
    assert torch.equal(prep.ctx.data.train.y.sort().values, torch.from_numpy(np.sort(
        load_dataset(cfg.dataset, cfg.seed, None).y_train)))
    assert run_rounds(prep).history[-1]["accuracy"] > 0.6


# ---------------------------------------------------------------------- bad values


BAD = [
    ({"dataset": {"normalize": "zscore"}}, "dataset.normalize"),
    ({"dataset": {"normalize": "per_channel", "normalize_mean": [0.1], "normalize_std": [0.0]}}, "dataset.normalize_std"),
    ({"dataset": {"normalize_mean": [0.1], "normalize_std": [0.3]}}, "dataset.normalize_mean"),
    ({"dataset": {"normalize": "per_channel", "normalize_mean": [0.1]}}, "dataset.normalize_mean"),
    ({"dataset": {"name": "synthetic_linreg", "normalize": "per_channel"}, "model": {"name": "linear"},
      "partition": {"scheme": "natural"}}, "dataset.normalize"),
    ({"partition": {"dirichlet_rule": "fedlab"}}, "partition.dirichlet_rule"),
    ({"partition": {"min_size": 0}}, "partition.min_size"),
    ({"partition": {"rotated_mode": "iid"}}, "partition.rotated_mode"),
    ({"partition": {"shard_size": 0}}, "partition.shard_size"),
    ({"model": {"name": "lenet5_pad"}}, "model.name"),
]


@pytest.mark.parametrize("over,key", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_one_line(over, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    msg = str(err.value)
    assert msg.startswith(f"config error: {key}") and "\n" not in msg


@pytest.mark.parametrize("setting,needle", [
    ("partition.dirichlet_rule=fedlab", "partition.dirichlet_rule"),
    ("dataset.normalize=zscore", "dataset.normalize"),
    ("model.name=lenet5_pad", "model.name"),
])
def test_cli_exits_2_with_one_line(workdir, monkeypatch, capsys, setting, needle):
    from flows.cli import main

    monkeypatch.chdir(workdir)
    assert main(["run", "fedavg_rotated_digits", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("partition,needle", [
    ({"scheme": "shards", "classes_per_client": 2, "shard_size": 1000}, "partition.shard_size"),
    ({"scheme": "rotated", "k": 2, "samples_per_client": 1000, "rotated_mode": "ifca"}, "partition.samples_per_client"),
    ({"scheme": "dirichlet", "alpha": 0.5, "min_size": 500}, "partition.min_size"),
])
def test_impossible_generators_exit_2_with_one_line(workdir, monkeypatch, capsys, partition, needle):
    import yaml

    from flows.cli import main

    monkeypatch.chdir(workdir)
    (workdir / "exp.yaml").write_text(yaml.safe_dump(tiny_config(partition=partition)))
    assert main(["run", "exp.yaml"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
