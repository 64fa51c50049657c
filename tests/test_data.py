"""Loaders (with tiny IDX and npz files written here) and every partition scheme."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import torch

from flockfl.errors import ConfigError
from flockfl.config import DatasetConfig
from flockfl.experiments import validate
from flockfl.data import build_client_data, build_or_load, load_dataset, make_partition
from flockfl.data.clients import rotate_images
from flockfl.data.images import read_idx
from flockfl.data.partition import label_histogram
from flockfl.data.store import load_partition, partition_path

from conftest import tiny_config


def write_idx(path, arr: np.ndarray, gz: bool = False) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def write_mnist_like(d, n_train=60, n_test=20, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    sfx = ".gz" if gz else ""
    xs = rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 256, (n_test, 28, 28))
    ys = np.arange(n_train) % 10, np.arange(n_test) % 10
    write_idx(d / f"train-images-idx3-ubyte{sfx}", xs[0], gz)
    write_idx(d / f"train-labels-idx1-ubyte{sfx}", ys[0], gz)
    write_idx(d / f"t10k-images-idx3-ubyte{sfx}", xs[1], gz)
    write_idx(d / f"t10k-labels-idx1-ubyte{sfx}", ys[1], gz)
    return xs, ys


# ---------------------------------------------------------------------- loaders


def test_digits_loader_split_is_stratified_and_scaled():
    ds = load_dataset(DatasetConfig(name="digits"), 0, 10)
    assert ds.x_train.shape[1:] == (1, 8, 8) and ds.x_train.max() <= 1.0 and ds.x_train.min() >= 0.0
    assert len(ds.y_train) + len(ds.y_test) == 1797
    frac = np.bincount(ds.y_test, minlength=10) / np.bincount(np.concatenate([ds.y_train, ds.y_test]), minlength=10)
    assert np.allclose(frac, 0.2, atol=0.02)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_loader_reads_plain_and_gzip(tmp_path, gz):
    xs, ys = write_mnist_like(tmp_path / "fm", gz=gz)
    ds = load_dataset(DatasetConfig(name="fashion_mnist", path=str(tmp_path / "fm")), 0, 4)
    assert ds.x_train.shape == (60, 1, 28, 28) and ds.x_test.shape == (20, 1, 28, 28)
    np.testing.assert_allclose(ds.x_train[:, 0], xs[0] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test, ys[1])
    assert ds.num_classes == 10


def test_idx_search_order_uses_data_raw(tmp_path, monkeypatch):
    write_mnist_like(tmp_path / "data" / "raw" / "mnist")
    monkeypatch.chdir(tmp_path)
    ds = load_dataset(DatasetConfig(name="mnist"), 0, 4)
    assert ds.meta["source"] == "data/raw/mnist"


def test_idx_missing_names_all_places_and_apt(tmp_path, monkeypatch):
    import flockfl.data.images as dsmod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(dsmod.SYSTEM_DIRS, "fashion_mnist", str(tmp_path / "usr/share/datasets/fashion-mnist"))
    with pytest.raises(ConfigError) as err:
        load_dataset(DatasetConfig(name="fashion_mnist", path=str(tmp_path / "nowhere")), 0, 4)
    msg = str(err.value)
    assert "nowhere" in msg and "data/raw/fashion_mnist" in msg and "usr/share/datasets/fashion-mnist" in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg and "\n" not in msg


def test_idx_truncated_is_refused(tmp_path):
    write_mnist_like(tmp_path)
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="truncated"):
        read_idx(f)


def test_npz_loader_natural_clients_and_groups(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x_train=rng.random((30, 5)), y_train=rng.integers(0, 3, 30), x_test=rng.random((9, 5)),
             y_test=rng.integers(0, 3, 9), client_train=np.repeat(np.arange(3), 10), client_test=np.repeat(np.arange(3), 3),
             group=np.array([0, 1, 1]))
    cfg = validate(tiny_config(dataset={"name": "npz", "path": str(path)}, partition={"scheme": "natural", "num_clients": 3},
                               model={"name": "mclr"}, train={"clients_per_round": 3}))
    ds = load_dataset(cfg.dataset, 0, 3)
    assert ds.num_classes == 3 and ds.task == "classification"
    part = make_partition(ds, cfg)
    assert [len(i) for i in part.train_idx] == [10, 10, 10] and [len(i) for i in part.test_idx] == [3, 3, 3]
    np.testing.assert_array_equal(part.group, [0, 1, 1])
    np.testing.assert_array_equal(ds.client_train[part.train_idx[2]], 2)


def test_npz_loader_errors(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="missing arrays"):
        load_dataset(DatasetConfig(name="npz", path=str(bad)), 0, 1)
    with pytest.raises(ConfigError, match="not a file"):
        load_dataset(DatasetConfig(name="npz", path=str(tmp_path / "none.npz")), 0, 1)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a readable"):
        load_dataset(DatasetConfig(name="npz", path=str(tmp_path / "junk.npz")), 0, 1)


def test_synthetic_linreg_matches_ifca_generator():
    cfg = DatasetConfig(name="synthetic_linreg", clusters=3, dim=7, samples_per_client=11, noise=0.0, separation=2.0)
    ds = load_dataset(cfg, 5, 12)
    theta = ds.meta["theta"]
    assert set(np.unique(theta)) <= {0.0, 2.0}
    np.testing.assert_array_equal(ds.group, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    for c in range(12):
        x, y = ds.x_train[ds.client_train == c], ds.y_train[ds.client_train == c]
        np.testing.assert_allclose(x @ theta[ds.group[c]], y, rtol=1e-4, atol=1e-4)  # σ = 0: exact
    again = load_dataset(cfg, 5, 12)
    np.testing.assert_array_equal(ds.x_train, again.x_train)


# ---------------------------------------------------------------------- schemes


SCHEME_CASES = {
    "iid": {},
    "dirichlet": {"alpha": 0.3},
    "shards": {"classes_per_client": 2},
    "rotated": {"k": 4},
    "label_swap": {"k": 3},
}


@pytest.mark.parametrize("scheme", sorted(SCHEME_CASES))
def test_scheme_sizes_disjoint_and_deterministic(scheme):
    over = {"partition": {"scheme": scheme, "num_clients": 20, **SCHEME_CASES[scheme]}}
    cfg = validate(tiny_config(**over))
    ds = load_dataset(cfg.dataset, cfg.seed, 20)
    p1, p2 = make_partition(ds, cfg), make_partition(ds, cfg)
    assert p1.content_hash == p2.content_hash
    all_train = np.concatenate(p1.train_idx)
    assert len(np.unique(all_train)) == len(all_train) == len(ds.y_train)  # disjoint, complete
    assert len(np.unique(np.concatenate(p1.test_idx))) == len(np.concatenate(p1.test_idx))
    assert min(len(i) for i in p1.train_idx) >= 1
    other = validate(tiny_config(seed=99, **over))
    assert make_partition(ds, other).content_hash != p1.content_hash


def test_iid_sizes_balanced():
    cfg = validate(tiny_config(partition={"scheme": "iid", "num_clients": 40}))
    ds = load_dataset(cfg.dataset, cfg.seed, 40)
    sizes = make_partition(ds, cfg).train_sizes()
    assert sizes.max() - sizes.min() <= 1 and 35 <= sizes.mean() <= 37  # ~36 per client, as in the IFCA demo


def test_dirichlet_alpha_controls_skew():
    def skew(alpha):
        cfg = validate(tiny_config(partition={"scheme": "dirichlet", "num_clients": 10, "alpha": alpha}))
        ds = load_dataset(cfg.dataset, cfg.seed, 10)
        p = make_partition(ds, cfg)
        h = label_histogram(ds.y_train, p.train_idx, 10)
        prop = h / h.sum(1, keepdims=True)
        return np.abs(prop - prop.mean(0)).sum(1).mean()

    assert skew(0.05) > 2 * skew(100.0)


def test_shards_gives_few_classes_and_matching_test_split():
    cfg = validate(tiny_config(partition={"scheme": "shards", "num_clients": 20, "classes_per_client": 2}))
    ds = load_dataset(cfg.dataset, cfg.seed, 20)
    p = make_partition(ds, cfg)
    assert np.mean([len(np.unique(ds.y_train[tr])) for tr in p.train_idx]) <= 2.6
    for tr, te in zip(p.train_idx, p.test_idx):
        train_classes = set(np.unique(ds.y_train[tr]))
        assert len(train_classes) <= 4  # two shards; a shard may straddle a label boundary
        assert set(np.unique(ds.y_test[te])) <= train_classes  # test follows the train distribution


def test_rotated_groups_and_transform():
    cfg = validate(tiny_config(partition={"scheme": "rotated", "num_clients": 8, "k": 4}))
    ds = load_dataset(cfg.dataset, cfg.seed, 8)
    p = make_partition(ds, cfg)
    np.testing.assert_array_equal(p.group, [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(p.angle, [0, 0, 90, 90, 180, 180, 270, 270])
    cd = build_client_data(ds, p)
    x5, _ = cd.train.client(5)
    raw = torch.from_numpy(ds.x_train[p.train_idx[5]])
    torch.testing.assert_close(x5, torch.rot90(raw, 2, dims=(-2, -1)))
    xt, _ = cd.test.client(3)
    torch.testing.assert_close(xt, torch.rot90(torch.from_numpy(ds.x_test[p.test_idx[3]]), 1, dims=(-2, -1)))


def test_non_right_angle_rotation_is_bilinear():
    x = torch.zeros(1, 1, 9, 9)
    x[0, 0, 4, :] = 1.0  # a horizontal bar
    r = rotate_images(x, 45.0)
    assert r[0, 0, 4, 4] > 0.9 and r[0, 0, 1, 7] > 0.5 and r[0, 0, 7, 1] > 0.5 and r[0, 0, 1, 1] < 0.1  # "/" diagonal
    torch.testing.assert_close(rotate_images(x, 90.0), torch.rot90(x, 1, dims=(-2, -1)))
    # the bilinear path turns the same way as rot90 (counter-clockwise)
    y = torch.zeros(1, 1, 9, 9)
    y[0, 0, 1, 2] = 1.0
    torch.testing.assert_close(rotate_images(y, 90.0001), torch.rot90(y, 1, dims=(-2, -1)), atol=1e-3, rtol=0)


def test_label_swap_permutes_labels_per_group():
    cfg = validate(tiny_config(partition={"scheme": "label_swap", "num_clients": 6, "k": 3}))
    ds = load_dataset(cfg.dataset, cfg.seed, 6)
    p = make_partition(ds, cfg)
    np.testing.assert_array_equal(p.group, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(p.label_perm[0], np.arange(10))
    np.testing.assert_array_equal(p.label_perm[2][:4], [1, 0, 2, 3])  # group 1 swaps 0↔1
    np.testing.assert_array_equal(p.label_perm[4][:4], [0, 1, 3, 2])  # group 2 swaps 2↔3
    cd = build_client_data(ds, p)
    _, y = cd.train.client(2)
    np.testing.assert_array_equal(y.numpy(), p.label_perm[2][ds.y_train[p.train_idx[2]]])


def test_impossible_partitions_are_config_errors():
    ds = load_dataset(DatasetConfig(name="digits"), 0, 1)
    with pytest.raises(ConfigError, match="shards"):
        make_partition(ds, validate(tiny_config(partition={"scheme": "shards", "num_clients": 1000, "classes_per_client": 3})))
    with pytest.raises(ConfigError, match="training samples"):
        make_partition(ds, validate(tiny_config(partition={"scheme": "iid", "num_clients": 5000})))
    with pytest.raises(ConfigError, match="natural"):
        make_partition(ds, validate(tiny_config(partition={"scheme": "natural", "num_clients": 12})))


def test_partition_file_cache_and_summary(tmp_path):
    cfg = validate(tiny_config(partition={"scheme": "dirichlet", "num_clients": 10, "alpha": 0.5, "name": "mine"}))
    ds = load_dataset(cfg.dataset, cfg.seed, 10)
    p, path, cached = build_or_load(ds, cfg, tmp_path)
    assert path == tmp_path / "mine.npz" and not cached
    summary = json.loads(path.with_suffix(".json").read_text())
    assert summary["content_hash"] == p.content_hash and summary["num_clients"] == 10
    assert len(summary["label_histograms"]) == 10 and sum(summary["train_sizes"]) == len(ds.y_train)
    p2, _, cached2 = build_or_load(ds, cfg, tmp_path)
    assert cached2 and p2.content_hash == p.content_hash
    assert load_partition(path).content_hash == p.content_hash
    # overriding a setting never overwrites the named partition
    other = validate(tiny_config(partition={"scheme": "dirichlet", "num_clients": 10, "alpha": 0.9, "name": "mine"}))
    assert partition_path(other, tmp_path) != path
    # a damaged file is rebuilt, not trusted
    path.write_bytes(b"garbage")
    p3, _, cached3 = build_or_load(ds, cfg, tmp_path)
    assert not cached3 and p3.content_hash == p.content_hash


def test_uneven_client_sizes_follow_difca_and_cover_the_data(tmp_path):
    from flockfl.data.partition import uneven_sizes
    from flockfl.rng import np_rng

    sizes = uneven_sizes(1000, 12, np_rng(0, purpose="t"))
    assert sizes.sum() == 1000 and sizes.min() >= 1 and sizes.max() < 2 * 1000 // 12 * 1.5 and len(set(sizes)) > 6
    cfg = validate(tiny_config(partition={"scheme": "rotated", "k": 2, "client_sizes": "uneven"}))
    ds = load_dataset(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    part, _, _ = build_or_load(ds, cfg, tmp_path)
    lens = [len(i) for i in part.train_idx]
    assert sum(lens) == len(ds.y_train) and len(set(lens)) > 6
    assert np.array_equal(np.sort(np.concatenate(part.train_idx)), np.arange(len(ds.y_train)))
    with pytest.raises(ConfigError, match="partition.client_sizes: 'uneven' applies to"):
        validate(tiny_config(partition={"scheme": "dirichlet", "client_sizes": "uneven"}))


def test_a_dataset_is_loaded_once_per_process_until_its_file_changes(tmp_path):
    """``flockfl run`` checks the partition before its flow and the flow loads the data again:
    the second load shares the first's arrays (in its own Dataset: PFLlib's merge replaces the
    splits on the caller's copy only); a changed npz file, or other settings, load anew."""
    import os

    from flockfl.config import DatasetConfig
    from flockfl.data.datasets import load_dataset

    from flockfl.data.datasets import merge_splits

    digits = DatasetConfig(name="digits")
    a, b = load_dataset(digits, 0, 10), load_dataset(digits, 0, 10)
    assert a is not b and a.x_train is b.x_train and a.y_test is b.y_test
    assert load_dataset(digits, 1, 10).x_train is not a.x_train
    n = len(a.y_train)
    merge_splits(a)  # in place, on this caller's Dataset only
    assert len(a.y_train) > n and len(load_dataset(digits, 0, 10).y_train) == n == len(b.y_train)
    assert "merged_splits" not in load_dataset(digits, 0, 10).meta
    path = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.normal(size=(20, 3)).astype(np.float32), y_train=np.arange(20) % 2,
             x_test=rng.normal(size=(6, 3)).astype(np.float32), y_test=np.arange(6) % 2)
    cfg = DatasetConfig(name="npz", path=str(path))
    first = load_dataset(cfg, 0, 4)
    assert load_dataset(cfg, 0, 4).x_train is first.x_train
    np.savez(path, x_train=np.zeros((20, 3), np.float32), y_train=np.arange(20) % 2,
             x_test=np.zeros((6, 3), np.float32), y_test=np.arange(6) % 2)
    os.utime(path, ns=(first_ns := path.stat().st_mtime_ns + 10**9, first_ns))
    again = load_dataset(cfg, 0, 4)
    assert again.x_train is not first.x_train and not again.x_train.any()


def test_the_bundled_digits_are_read_without_scikit_learn_as_it_reads_them():
    from sklearn.datasets import load_digits as sk_digits

    from flockfl.data.images import _bundled_digits

    images, target = _bundled_digits()
    bunch = sk_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert np.array_equal(target, bunch.target)
