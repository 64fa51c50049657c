"""PFLlib's leaderboard setting (spec personalised-baselines.md §1, §12.2): the per-client local
test split (``partition.test_split=local``), PFLlib's pathological split (``pfllib_pat``), its
4-layer CNN (``pfllib_cnn``), and the repro table ``pfllib_fmnist``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flockfl.config import DatasetConfig
from flockfl.data import build_client_data
from flockfl.data.dataset import Dataset
from flockfl.data.datasets import load_dataset, merge_splits
from flockfl.data.partition import key_hash
from flockfl.data.schemes import SCHEMES, make_partition
from flockfl.data.store import build_or_load, load_partition
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from models import build_model

from conftest import assert_trainers_agree, tiny_config


def digits() -> Dataset:
    return load_dataset(DatasetConfig(name="digits"), 3, None)


def local_cfg(**partition):
    part = {"scheme": "iid", "num_clients": 10, "test_split": "local", **partition}
    return validate(tiny_config(partition=part, train={"clients_per_round": 1}))


# ---------------------------------------------------------------------- the local split

LOCAL_SCHEMES = [dict(scheme="iid"), dict(scheme="dirichlet", alpha=0.3), dict(scheme="shards", classes_per_client=2),
                 dict(scheme="shards_pct", rho=20), dict(scheme="pfllib_pat", classes_per_client=2)]


@pytest.mark.parametrize("part", LOCAL_SCHEMES, ids=[p["scheme"] for p in LOCAL_SCHEMES])
def test_each_client_splits_its_own_share_75_25(part):
    """The scheme deals the pooled train + test sets; each client's share is split, disjoint,
    ⌈25 %⌉ to test (sklearn's n − ⌊0.75·n⌋), and train ∪ test is exactly that share."""
    cfg = local_cfg(**part)
    ds = digits()
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    p = make_partition(ds, cfg)
    assert len(ds.y_train) == len(ds.y_test) == n_train + n_test and ds.x_train is ds.x_test  # one pool
    assert p.info["merged_splits"] == {"train": n_train, "test": n_test}
    shares = SCHEMES[part["scheme"]](ds, cfg.partition, cfg.seed).train_idx  # the scheme alone, on the pool
    for share, tr, te in zip(shares, p.train_idx, p.test_idx):
        n = len(share)
        assert len(te) == n - int(np.floor(0.75 * n)) and len(tr) == n - len(te)
        assert not np.intersect1d(tr, te).size
        np.testing.assert_array_equal(np.union1d(tr, te), np.sort(share))
    if part["scheme"] in ("iid", "pfllib_pat"):  # these deal every sample: the test sets hold original training data
        everything = np.concatenate(p.train_idx + p.test_idx)
        assert len(everything) == len(np.unique(everything)) == n_train + n_test
        assert (np.concatenate(p.test_idx) < n_train).any() and (np.concatenate(p.train_idx) >= n_train).any()


def test_the_split_is_random_per_client_not_stratified():
    p = make_partition(digits(), local_cfg(local_test_fraction=0.4))
    sizes = p.train_sizes() + p.test_sizes()
    np.testing.assert_array_equal(p.test_sizes(), sizes - np.floor(0.6 * sizes).astype(int))
    again = make_partition(digits(), local_cfg(local_test_fraction=0.4))
    assert all(np.array_equal(a, b) for a, b in zip(p.test_idx, again.test_idx))  # deterministic
    other = make_partition(digits(), validate(tiny_config(seed=4, partition={
        "scheme": "iid", "num_clients": 10, "test_split": "local", "local_test_fraction": 0.4}, train={"clients_per_round": 1})))
    assert not np.array_equal(p.test_idx[0], other.test_idx[0])


def test_the_local_split_is_in_the_content_address_and_json(tmp_path):
    plain = validate(tiny_config(partition={"scheme": "iid", "num_clients": 10}, train={"clients_per_round": 1}))
    assert "test_split" not in plain.partition_key()["partition"]  # global (the default): earlier addresses unchanged
    local = local_cfg()
    assert {"test_split": "local", "local_test_fraction": 0.25}.items() <= local.partition_key()["partition"].items()
    other = local_cfg(local_test_fraction=0.3)
    assert len({key_hash(c.partition_key()) for c in (plain, local, other)}) == 3

    ds = digits()
    p, path, cached = build_or_load(ds, local, tmp_path)
    assert not cached
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["generator"] == {"scheme": "iid", "test_split": "local", "local_test_fraction": 0.25}
    raw = digits()
    assert meta["merged_splits"] == {"train": len(raw.y_train), "test": len(raw.y_test)}
    assert load_partition(path).content_hash == p.content_hash
    fresh = digits()  # a run loads the dataset afresh: the cache pools it before checking the file
    again, _, cached = build_or_load(fresh, local, tmp_path)
    assert cached and again.content_hash == p.content_hash and fresh.x_test is fresh.x_train
    global_p, _, _ = build_or_load(digits(), plain, tmp_path)
    assert global_p.content_hash != p.content_hash


def test_client_data_trains_and_tests_on_the_clients_own_samples(tmp_path):
    ds = digits()
    x_all = np.concatenate([ds.x_train, ds.x_test])
    p, _, _ = build_or_load(ds, local_cfg(), tmp_path)
    data = build_client_data(ds, p)
    np.testing.assert_array_equal(data.test.sizes, p.test_sizes())
    for i in (0, 9):
        lo, hi = data.test.offsets[i], data.test.offsets[i + 1]
        np.testing.assert_array_equal(data.test.x[lo:hi].numpy(), x_all[p.test_idx[i]])


def test_merging_is_in_place_and_once():
    ds = digits()
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    assert merge_splits(merge_splits(ds)) is ds and len(ds.y_train) == n_train + n_test
    assert ds.meta["merged_splits"] == {"train": n_train, "test": n_test}


def test_a_local_run_trains_with_both_trainers_alike(tmp_path):
    cfg_of = lambda engine: validate(tiny_config(  # noqa: E731
        partition={"scheme": "pfllib_pat", "num_clients": 10, "classes_per_client": 2, "test_split": "local"},
        model={"name": "pfllib_cnn"}, algorithm={"name": "fedper"},
        train={"rounds": 2, "clients_per_round": 10, "batch_size": 10, "lr": 0.005, "engine": engine},
        eval={"report": "best"}))
    ref, vec = assert_trainers_agree(cfg_of, tmp_path)
    last = vec.history[-1]
    assert 0.0 <= last["accuracy"] <= 1.0 and "accuracy__proportional__clients" in last


# ---------------------------------------------------------------------- PFLlib's pathological split

def labelled(n_per_class: int, classes: int = 10) -> Dataset:
    """Labels only (the split reads nothing else), in dataset order 0, 1, …, 9, 0, 1, …"""
    y = np.tile(np.arange(classes), n_per_class).astype(np.int64)
    return Dataset("labels", np.zeros((len(y), 1, 1, 1), np.float32), y, np.zeros((10, 1, 1, 1), np.float32),
                   np.arange(10) % classes, num_classes=classes)


def test_pfllib_pat_gives_groups_of_four_clients_two_disjoint_labels():
    """20 clients, 10 classes, 2 each (PFLlib's FMNIST): class c goes to the first 4 clients with
    room, so clients 4g..4g+3 hold classes 2g, 2g+1; sizes of the first three are drawn from
    [m/10, m) (m = 7000/4), the fourth takes the rest; every sample once, in dataset order."""
    ds = labelled(7000)
    cfg = local_cfg(scheme="pfllib_pat", num_clients=20, classes_per_client=2)
    p = SCHEMES["pfllib_pat"](ds, cfg.partition, cfg.seed)
    hist = np.stack([np.bincount(ds.y_train[i], minlength=10) for i in p.train_idx])
    for i in range(20):
        g = i // 4
        assert set(np.flatnonzero(hist[i])) == {2 * g, 2 * g + 1}
    for c in range(10):
        counts = hist[4 * (c // 2): 4 * (c // 2) + 4, c]
        assert counts.sum() == 7000 and ((counts[:3] >= 175) & (counts[:3] < 1750)).all() and counts[3] > 1750
        owners = [np.flatnonzero(ds.y_train[p.train_idx[i]] == c) for i in range(4 * (c // 2), 4 * (c // 2) + 4)]
        firsts = [p.train_idx[4 * (c // 2) + k][o].min() for k, o in enumerate(owners)]
        assert firsts == sorted(firsts)  # contiguous runs of the class, in client order
    everything = np.concatenate(p.train_idx)
    assert len(np.unique(everything)) == len(everything) == len(ds.y_train)
    assert len(set(hist.sum(1))) > 5  # unbalanced
    other = SCHEMES["pfllib_pat"](ds, cfg.partition, cfg.seed + 1)
    assert not all(np.array_equal(a, b) for a, b in zip(p.train_idx, other.train_idx))


def test_pfllib_pat_with_more_classes_per_client_and_too_few_samples():
    ds = labelled(300)
    cfg = local_cfg(scheme="pfllib_pat", num_clients=10, classes_per_client=3)
    p = SCHEMES["pfllib_pat"](ds, cfg.partition, cfg.seed)
    assert all(1 <= len(np.unique(ds.y_train[i])) <= 3 for i in p.train_idx)
    with pytest.raises(ConfigError, match="^partition.num_clients: class 0 has 2 samples for 4 clients"):
        cfg = local_cfg(scheme="pfllib_pat", num_clients=20, classes_per_client=2)
        SCHEMES["pfllib_pat"](labelled(2), cfg.partition, cfg.seed)


# ---------------------------------------------------------------------- the 4-layer CNN

def test_pfllib_cnn_layers_and_parameter_count():
    """Spec §1: conv1 832, conv2 51,264, fc1 524,800, head 5,130; 582,026 in all, body 576,896."""
    from flockfl.algorithms.partial import resolve_layers

    m = build_model("pfllib_cnn", (1, 28, 28), 10)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"conv1.weight": (32, 1, 5, 5), "conv1.bias": (32,), "conv2.weight": (64, 32, 5, 5),
                      "conv2.bias": (64,), "fc1.weight": (512, 1024), "fc1.bias": (512,), "fc.weight": (10, 512),
                      "fc.bias": (10,)}
    count = lambda names: sum(int(np.prod(shapes[n])) for n in names)  # noqa: E731
    assert [count([f"{k}.weight", f"{k}.bias"]) for k in ("conv1", "conv2", "fc1", "fc")] == [832, 51264, 524800, 5130]
    head = resolve_layers(m, "head")
    assert head == ["fc.weight", "fc.bias"] and count(shapes) == 582026 and count(set(shapes) - set(head)) == 576896
    assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("pfllib_cnn", (3, 32, 32), 10).fc1.in_features == 1600  # PFLlib's dim for CIFAR
    assert build_model("pfllib_cnn", (1, 8, 8), 10)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)  # digits: 3×3 same convs


# ---------------------------------------------------------------------- bad values

BAD = [
    ({"partition": {"test_split": "pfllib"}}, "partition.test_split"),
    ({"partition": {"test_split": "local", "local_test_fraction": 1.0}}, "partition.local_test_fraction"),
    ({"partition": {"test_split": "local", "local_test_fraction": 0}}, "partition.local_test_fraction"),
    ({"partition": {"local_test_fraction": 0.3}}, "partition.local_test_fraction"),
    ({"partition": {"test_split": "local"}, "eval": {"test_set": "label_union"}}, "eval.test_set"),
    ({"partition": {"scheme": "pat"}}, "partition.scheme"),
    ({"model": {"name": "pfllib"}}, "model.name"),
]


@pytest.mark.parametrize("over,key", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_one_line(over, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    msg = str(err.value)
    assert msg.startswith(f"config error: {key}") and "\n" not in msg


@pytest.mark.parametrize("over,needle", [
    ({"partition": {"test_split": "local"}, "eval": {"test_set": "label_union"}}, "eval.test_set"),
    ({"partition": {"local_test_fraction": 0.5}}, "partition.local_test_fraction"),
    # digits: about 180 samples a class, each dealt to ⌈1000/10·2⌉ = 200 clients
    ({"partition": {"scheme": "pfllib_pat", "num_clients": 1000}}, "partition.num_clients"),
    # one sample a client: nothing left to train on
    ({"partition": {"scheme": "iid", "num_clients": 1797, "test_split": "local"}}, "partition.local_test_fraction"),
])
def test_cli_exits_2_with_one_line(workdir, monkeypatch, capsys, over, needle):
    import yaml

    from flows.cli import main

    monkeypatch.chdir(workdir)
    (workdir / "exp.yaml").write_text(yaml.safe_dump(tiny_config(**over)))
    assert main(["run", "exp.yaml"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------------- the repro table

def test_the_pfllib_table_is_covered_by_the_generic_repro_checks(tmp_path):
    """tests/test_repro.py validates every cell of every budget of every table in configs/repro/;
    here, what this table must hold: PFLlib's setting and numbers, a cpu budget (a tenth of the data)
    and cpu_full (all of it, 5 rounds)."""
    from flows.repro_plan import plan_repro
    from flows.repro_tables import load_table, table_names

    assert "pfllib_fmnist" in table_names()
    t = load_table("pfllib_fmnist")
    assert list(t.rows) == ["FedAvg", "Per-FedAvg", "pFedMe", "Ditto", "APFL", "FedPer", "FedRep", "FedBABU",
                            "Per-FedAvg (PFLlib)", "APFL (PFLlib)", "Ditto (PFLlib)", "Local", "FedAvg+FT"]
    assert list(t.columns) == ["pathological", "Dir(0.1)"] and set(t.budgets) == {"paper", "cpu", "cpu_full"}
    assert t.budgets["cpu_full"] == {"train": {"rounds": 5, "eval_every": 1}}  # PFLlib's full data, 5 rounds
    assert t.published["PFLlib"]["FedRep"] == {"pathological": [99.56, 0.03], "Dir(0.1)": [97.56, 0.04]}
    assert t.tolerance == {"PFLlib": 2.0} and t.conventions[0]["metric"] == ["accuracy_finetuned", "accuracy"]
    plan = plan_repro("pfllib_fmnist", "paper", [0], None, None, [], "params.yaml", str(tmp_path))
    for child in plan.sweep.children:
        c = child.cfg
        assert (c.partition.num_clients, c.train.clients_per_round, c.train.rounds) == (20, 20, 2000)
        assert (c.train.local_epochs, c.train.batch_size, c.train.lr, c.train.momentum) == (1, 10, 0.005, 0.0)
        assert c.model.name == "pfllib_cnn" and c.partition.test_split == "local"
        assert (c.eval.test_set, c.eval.average, c.eval.report) == ("proportional", "samples", "best")
    schemes = {ch.cfg.partition.scheme for ch in plan.sweep.children}
    assert schemes == {"pfllib_pat", "dirichlet"}


def test_the_pfllib_rows_run_pfllibs_rules_beside_the_papers(tmp_path):
    """The '(PFLlib)' rows set the PFLlib variants (n_i weights, as PFLlib), the paper rows keep the
    registry's rules; 'Local' trains alone; 'FedAvg+FT' fine-tunes before every evaluation and is
    read through accuracy_finetuned (the conventions take the first metric a run has)."""
    from flows.repro_plan import plan_repro

    plan = plan_repro("pfllib_fmnist", "cpu", [0], None, ["pathological"], [], "params.yaml", str(tmp_path))
    assert len(plan.sweep.children) == 13
    by_algo = {}
    for child in plan.sweep.children:
        by_algo.setdefault(child.cfg.algorithm.name, []).append((child.cfg.algorithm.hyper(), child.cfg.train))
    pfa = [a for a, _ in by_algo["perfedavg"]]
    assert sorted(a["variant"] for a in pfa) == ["fo", "pfllib"]
    assert [a["weighting"] for a in pfa if a["variant"] == "pfllib"] == ["samples"]
    apfl = {a["variant"]: a for a, _ in by_algo["apfl"]}
    assert apfl["pfllib"]["alpha_l2"] == 0.02 and apfl["paper"]["alpha_l2"] == 0.0
    ditto = sorted((a["eval"], a["schedule"]) for a, _ in by_algo["ditto"])
    assert ditto == [("best_of", "sequential"), ("personal", "interleaved")]
    assert len(by_algo["local"]) == 1
    assert sorted(t.eval_finetune for _, t in by_algo["fedavg"]) == ["every", "off"]


# ---------------------------------------------------------------------- evaluation under the local split

def test_a_local_split_measures_no_label_union_and_summarises(tmp_path):
    """test_split=local: the clients' own held-out samples are the only test set, so no
    label_union metric is computed or logged; the summary and its reports still work."""
    from flockfl.eval_summary import summarise
    from flockfl.rounds import prepare, run_rounds

    cfg = validate(tiny_config(partition={"scheme": "iid", "num_clients": 10, "test_split": "local"},
                               algorithm={"name": "fedrep"}, train={"rounds": 2, "clients_per_round": 5},
                               eval={"report": "best"}))
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    logged = {k for row in state.history for k in row}
    assert not [k for k in logged if "label_union" in k]
    assert {"accuracy__proportional__samples", "accuracy_personal__proportional__clients",
            "accuracy__proportional__clients__best"} <= logged
    s = summarise(state)
    assert set(s["reports"]) == {"proportional/samples", "proportional/clients"}
    assert s["protocol"]["report"] == "best" and 0.0 <= s["metrics"]["accuracy"] <= 1.0
    assert s["metrics"]["accuracy__proportional__samples__best"] == max(
        r["accuracy__proportional__samples"] for r in state.history if "accuracy__proportional__samples" in r)
    # a global test split still measures both
    glob = run_rounds(prepare(validate(tiny_config(partition={"scheme": "iid", "num_clients": 10},
                                                   train={"rounds": 1, "clients_per_round": 5})), tmp_path / "g"))
    assert "accuracy__label_union__samples" in glob.history[-1]


# ---------------------------------------------------------------------- pfllib_cnn is a classifier

def test_pfllib_cnn_is_listed_among_the_classifiers(tmp_path):
    from flockfl.config import classifier_list
    from flockfl.rounds import check_task

    assert "pfllib_cnn" in classifier_list() and "linear" not in classifier_list()
    with pytest.raises(ValueError, match=r"needs a classifier \(mclr, .*cnn_bn, pfllib_cnn or pfl_cnn\)"):
        validate(tiny_config(model={"name": "linear"}))
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros(1))
    cfg = validate(tiny_config(dataset={"name": "npz", "path": str(path)}, model={"name": "linear"}))
    with pytest.raises(ConfigError, match=r"so it needs a classifier \(.*pfllib_cnn or pfl_cnn\)"):
        check_task(cfg, digits())
    validate(tiny_config(model={"name": "pfllib_cnn"}))  # accepted as a classifier of a classification dataset
