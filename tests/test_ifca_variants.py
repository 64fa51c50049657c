"""IFCA's variants: weight sharing, the pretrain_kmeans initialisation, one-shot clustering
(Alg. 1, ``ifca_oneshot``), and the ``synthetic_fedprox`` dataset. Both trainers agree,
resume is bit-identical, the papers' sanity properties hold, and every new key has a
one-line config error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, tiny_config

from flockfl.algorithms.layout import parameter_names, shared_parameters
from flockfl.errors import ConfigError
from flockfl.config import DatasetConfig, deep_merge
from flockfl.experiments import validate
from flockfl.data import load_dataset
from flockfl.data.datasets import check_natural_only
from flockfl.engine import train_reference
from flockfl.rounds import prepare, run_rounds
from flockfl.state import load_latest, save_checkpoint

VARIANTS = [
    {"name": "ifca", "k": 2, "init": "random", "shared": "all_but_last"},
    {"name": "ifca", "k": 3, "init": "random", "shared": "1.", "option": "gradient"},
    {"name": "ifca", "k": 2, "init": "pretrain_kmeans"},
    {"name": "ifca", "k": 2, "init": "pretrain_kmeans", "pretrain_embedding": "edc", "shared": "all_but_last",
     "pretrain_clients": 8},
    {"name": "ifca_oneshot", "k": 2},
    {"name": "ifca_oneshot", "k": 3, "start": "init", "weighting": "uniform"},
]
IDS = [",".join(f"{k}={v}" for k, v in a.items()) for a in VARIANTS]


def cfg_of(algo: dict, **train):
    return validate(tiny_config(algorithm=algo, train={"rounds": 4, "clients_per_round": 6, **train}))


def linreg_cfg(**over):
    base = {"dataset": {"name": "synthetic_linreg", "clusters": 2, "dim": 20, "samples_per_client": 100, "noise": 0.1,
                        "separation": 1.0},
            "partition": {"scheme": "natural", "num_clients": 40}, "model": {"name": "linear"},
            "train": {"clients_per_round": 40, "full_batch": True, "engine": "vectorized", "local_steps": 5, "lr": 0.05}}
    return validate(tiny_config(**deep_merge(base, over)))


# ---------------------------------------------------------------------- engines and resume


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_both_trainers_agree(tmp_path, algo):
    assert_trainers_agree(lambda e: cfg_of(algo, engine=e), tmp_path)


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_resume_is_bit_identical_and_never_redoes_the_pre_federation(tmp_path, algo):
    cfg = cfg_of(algo, engine="vectorized")

    def refuse(*_):
        raise AssertionError("the pre-federation step ran again on resume")

    def forbid_pre_federation(prep):
        prep.algorithm.pre_federation = refuse

    assert_resume_bit_identical(cfg, tmp_path, until=2, prepare_resumed=forbid_pre_federation)


# ---------------------------------------------------------------------- weight sharing


def test_shared_parameter_names():
    names = parameter_names("mlp", 16)
    assert names == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert shared_parameters("none", names) == []
    assert shared_parameters("all_but_last", names) == ["1.weight", "1.bias"]
    assert shared_parameters("1.weight", names) == ["1.weight"]
    assert shared_parameters(" 1.bias , 3.bias ", names) == ["1.bias", "3.bias"]
    assert shared_parameters("all_but_last", parameter_names("lenet5")) == [n for n in parameter_names("lenet5")
                                                                           if not n.startswith("11.")]


@pytest.mark.parametrize("option", ["model", "gradient"])
def test_shared_parameters_are_one_tensor_and_the_heads_differ(tmp_path, option):
    cfg = cfg_of({"name": "ifca", "k": 3, "init": "random", "shared": "all_but_last", "option": option}, rounds=2)
    state = run_rounds(prepare(cfg, tmp_path))
    for name in ("1.weight", "1.bias"):
        v = state.models[name]
        assert v.stride(0) == 0  # kept once: a stride-0 view of one tensor
        assert all(torch.equal(v[j], v[0]) for j in range(3))
    assert not torch.equal(state.models["3.weight"][0], state.models["3.weight"][1])
    # ... and once in a checkpoint, which loads back the same
    save_checkpoint(state, tmp_path / "run")
    back, _ = load_latest(tmp_path / "run")
    assert back.models["1.weight"].stride(0) == 0 and back.digest() == state.digest()


def test_shared_parameters_are_the_weighted_mean_over_every_participant(tmp_path):
    cfg = cfg_of({"name": "ifca", "k": 2, "init": "random", "shared": "all_but_last", "weighting": "samples"})
    prep = prepare(cfg, tmp_path)
    alg, state = prep.algorithm, prep.algorithm.init_state(prep.ctx)
    spec = alg.local_spec(state, prep.ctx, np.array([0, 1, 5, 6, 7, 11]), 0)
    res = train_reference(prep.ctx.model, spec, prep.ctx.data.train, "classification", cfg.seed, 0)
    assign = alg.cluster(state, prep.ctx, spec, res)
    assert len(set(assign.tolist())) == 2  # both clusters chosen: the shared mean is not a cluster mean
    new = alg.aggregate(state, prep.ctx, spec, res, assign)
    w = torch.from_numpy(res.num_samples / res.num_samples.sum()).float()
    for name in ("1.weight", "1.bias"):
        expect = (w @ res.params[name].reshape(len(w), -1)).reshape(res.params[name].shape[1:])
        torch.testing.assert_close(new.models[name][0], expect)
        torch.testing.assert_close(new.models[name][1], expect)
    for j in range(2):  # heads: the mean of the cluster's own members
        members = np.flatnonzero(assign == j)
        wj = torch.from_numpy(res.num_samples[members] / res.num_samples[members].sum()).float()
        expect = (wj @ res.params["3.weight"][members].reshape(len(members), -1)).reshape(res.params["3.weight"].shape[1:])
        torch.testing.assert_close(new.models["3.weight"][j], expect)


@pytest.mark.parametrize("option", ["model", "gradient"])
def test_k1_with_sharing_is_plain_ifca_k1(tmp_path, option):
    states = {}
    for shared in ("none", "all_but_last"):
        cfg = cfg_of({"name": "ifca", "k": 1, "shared": shared, "option": option}, rounds=3)
        states[shared] = run_rounds(prepare(cfg, tmp_path))
    for k in states["none"].models:
        assert torch.equal(states["none"].models[k], states["all_but_last"].models[k]), k


def test_clients_choose_with_the_full_model(tmp_path):
    """With a shared trunk the k models differ only in their heads; a client's choice is still
    its lowest loss under the whole model (trunk + head j)."""
    cfg = cfg_of({"name": "ifca", "k": 2, "init": "random", "shared": "all_but_last"})
    prep = prepare(cfg, tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    spec = prep.algorithm.local_spec(state, prep.ctx, np.arange(12), 0)
    from torch.func import functional_call

    for i, c in enumerate(spec.clients):
        x, y = prep.ctx.data.train.client(int(c))
        loss = [float(torch.nn.functional.cross_entropy(functional_call(prep.ctx.model, {k: v[j] for k, v in state.models.items()}, (x,)), y))
                for j in range(2)]
        assert spec.meta["model_of_client"][i] == int(np.argmin(loss))


# ---------------------------------------------------------------------- pretrain_kmeans


def test_pretrain_kmeans_finds_the_rotations(tmp_path):
    """Rotated digits, k = 4: the pre-training pass already nearly separates the rotations, and
    after 15 rounds they are found exactly, on seeds where random and balanced_restart merge two."""
    from sklearn.metrics import adjusted_rand_score

    for seed in (0, 3, 4):
        cfg = validate(tiny_config(seed=seed, algorithm={"name": "ifca", "k": 4, "init": "pretrain_kmeans"},
                                   model={"hidden": 64}, partition={"scheme": "rotated", "num_clients": 40, "k": 4},
                                   train={"rounds": 15, "clients_per_round": 40, "local_epochs": 2, "batch_size": 10}))
        prep = prepare(cfg, tmp_path)
        state = run_rounds(prep)
        clients, pre = state.algo["pretrain_clients"].numpy(), state.algo["pretrain_labels"].numpy()
        assert adjusted_rand_score(prep.ctx.data.group[clients], pre) >= 0.8
        assert state.history[-1]["ari"] == 1.0


def test_pretrain_kmeans_cost_and_cohort(tmp_path):
    cfg = cfg_of({"name": "ifca", "k": 2, "init": "pretrain_kmeans"})
    state = run_rounds(prepare(cfg, tmp_path), until=1)
    # default cohort: max(clients_per_round, 20·k) = 40, capped at the 12 clients that federate
    assert state.algo["pretrain_clients"].tolist() == list(range(12))
    per_model = sum(v[0].numel() for v in state.models.values()) * 4
    cost = state.driver.pre_federation
    assert cost["bytes_up"] == cost["bytes_down"] == 12 * per_model
    assert sum(state.meta["pretrain_cluster_sizes"]) == 12
    few = run_rounds(prepare(cfg_of({"name": "ifca", "k": 2, "init": "pretrain_kmeans", "pretrain_clients": 5}), tmp_path),
                     until=1)
    chosen = few.algo["pretrain_clients"].numpy()
    assert len(chosen) == 5 and len(set(chosen.tolist())) == 5
    assert sum(few.meta["pretrain_cluster_sizes"]) == 5


def test_other_inits_have_no_pre_federation_and_k1_stays_fedavg(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "ifca", "k": 2, "init": "random"}), tmp_path), until=1)
    assert "pre_federation" not in state.meta
    states = {}
    for name, extra in (("ifca", {"k": 1, "init": "pretrain_kmeans"}), ("fedavg", {})):
        cfg = validate(tiny_config(algorithm={"name": name, "weighting": "uniform", **extra}, train={"rounds": 3}))
        states[name] = run_rounds(prepare(cfg, tmp_path))
    assert "pre_federation" not in states["ifca"].meta
    for k in states["ifca"].models:
        torch.testing.assert_close(states["ifca"].models[k], states["fedavg"].models[k])


def test_pretrain_kmeans_is_deterministic_and_seeds_models_from_cluster_means(tmp_path):
    cfg = cfg_of({"name": "ifca", "k": 2, "init": "pretrain_kmeans"})
    a = run_rounds(prepare(cfg, tmp_path), until=0)
    b = run_rounds(prepare(cfg, tmp_path), until=0)
    assert a.digest() == b.digest()
    assert not torch.equal(a.models["3.weight"][0], a.models["3.weight"][1])


# ---------------------------------------------------------------------- one-shot clustering (Alg. 1)


@pytest.mark.parametrize("k", [2, 4])
def test_oneshot_recovers_the_linear_mixture(tmp_path, k):
    # spec §2.2 sanity test: n ≥ 2d, so local least squares is well posed; k-means = the truth
    cfg = linreg_cfg(dataset={"clusters": k, "dim": 20, "samples_per_client": 40},
                     algorithm={"name": "ifca_oneshot", "k": k}, train={"rounds": 3})
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(prep.ctx.data.group, state.assignments) == 1.0
    assert state.history[-1]["ari"] == 1.0
    assert state.history[-1]["min_dist"] < 0.05  # each cluster starts at its members' mean ERM
    cost = state.driver.pre_federation
    assert cost["bytes_up"] == 40 * 20 * 4 and cost["bytes_down"] == 0  # θ̃_i up, nothing down
    np.testing.assert_array_equal(state.assignment_history[-1], state.assignments)  # frozen


def test_oneshot_least_squares_is_the_closed_form(tmp_path):
    cfg = linreg_cfg(algorithm={"name": "ifca_oneshot", "k": 2}, partition={"num_clients": 4},
                     train={"clients_per_round": 4, "rounds": 1})
    prep = prepare(cfg, tmp_path)
    from flockfl.algorithms.ifca_oneshot import least_squares

    theta = least_squares(prep.ctx, np.arange(4))["1.weight"]
    for c in range(4):
        x, y = prep.ctx.data.train.client(c)
        want = np.linalg.lstsq(x.double().numpy(), y.double().numpy(), rcond=None)[0]
        np.testing.assert_allclose(theta[c, 0].numpy(), want, rtol=1e-5, atol=1e-6)


def test_oneshot_with_sgd_erm_clusters_rotated_digits(tmp_path):
    cfg = validate(tiny_config(seed=0, algorithm={"name": "ifca_oneshot", "k": 2, "erm_epochs": 3},
                               partition={"scheme": "rotated", "num_clients": 20, "k": 2},
                               train={"rounds": 2, "clients_per_round": 10}))
    state = run_rounds(prepare(cfg, tmp_path))
    assert state.history[-1]["ari"] == 1.0
    per_model = sum(v[0].numel() for v in state.models.values()) * 4
    assert state.driver.pre_federation["bytes_up"] == state.driver.pre_federation["bytes_down"] == 20 * per_model


def test_oneshot_newcomers_join_the_nearest_centre(tmp_path):
    cfg = linreg_cfg(dataset={"samples_per_client": 40}, algorithm={"name": "ifca_oneshot", "k": 2},
                     partition={"unseen_fraction": 0.25}, train={"clients_per_round": 20, "rounds": 2})
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    new = state.driver.newcomers
    truth, seen = prep.ctx.data.group, prep.ctx.seen
    # map each k-means cluster to the truth through the federating clients, then check the newcomers
    mapping = {int(j): int(np.bincount(truth[seen][state.assignments[seen] == j]).argmax()) for j in range(2)}
    assert [mapping[j] for j in new["clusters"]] == truth[np.array(new["clients"])].tolist()
    assert "nearest k-means centre" in new["rule"]


# ---------------------------------------------------------------------- config errors


def one_line_error(algo: dict, key: str, **over) -> str:
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm=algo, **over))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"config error: algorithm.{key}:"), msg
    return msg


@pytest.mark.parametrize("algo, key, fragment", [
    ({"name": "ifca", "shared": "7."}, "shared", "matches no parameter"),
    ({"name": "ifca", "shared": "1.,"}, "shared", "empty prefix"),
    ({"name": "ifca", "shared": "1.,3."}, "shared", "shares every parameter"),
    ({"name": "ifca", "shared": ""}, "shared", "a string"),
    ({"name": "ifca", "shared": 3}, "shared", "a string"),
    ({"name": "ifca", "init": "kmeans"}, "init", "pretrain_kmeans"),
    ({"name": "ifca", "pretrain_clients": 0}, "pretrain_clients", "1 ≤ x"),
    ({"name": "ifca", "k": 3, "init": "pretrain_kmeans", "pretrain_clients": 2}, "pretrain_clients", "at least 3"),
    ({"name": "ifca", "init": "pretrain_kmeans", "pretrain_clients": 13}, "pretrain_clients", "exceeds"),
    ({"name": "ifca", "pretrain_epochs": 0}, "pretrain_epochs", "1 ≤ x"),
    ({"name": "ifca", "pretrain_epochs": 1.5}, "pretrain_epochs", "an integer"),
    ({"name": "ifca", "pretrain_embedding": "pca"}, "pretrain_embedding", "updates, edc"),
    ({"name": "ifca_oneshot", "k": 0}, "k", "1 ≤ x"),
    ({"name": "ifca_oneshot", "erm": "logistic"}, "erm", "least_squares"),
    ({"name": "ifca_oneshot", "erm": "least_squares"}, "erm", "model.name=mlp"),
    ({"name": "ifca_oneshot", "erm_epochs": 0}, "erm_epochs", "1 ≤ x"),
    ({"name": "ifca_oneshot", "start": "zero"}, "start", "cluster_mean, init"),
    ({"name": "ifca_oneshot", "weighting": "equal"}, "weighting", "samples, uniform"),
])
def test_bad_values_are_one_line_errors(algo, key, fragment):
    assert fragment in one_line_error(algo, key)


def test_the_shared_key_is_checked_against_the_chosen_model():
    one_line_error({"name": "ifca", "shared": "all_but_last"}, "shared", model={"name": "mclr"})
    validate(tiny_config(algorithm={"name": "ifca", "shared": "all_but_last"}, model={"name": "lenet5"}))


# ---------------------------------------------------------------------- synthetic_fedprox


def fedprox_cfg(**over):
    base = {"dataset": {"name": "synthetic_fedprox"}, "partition": {"scheme": "natural", "num_clients": None},
            "model": {"name": "mclr"}, "algorithm": {"name": "fedavg"},
            "train": {"rounds": 5, "clients_per_round": 10, "batch_size": 10, "lr": 0.05}}
    return validate(deep_merge(tiny_config(), deep_merge(base, over)))


def test_synthetic_fedprox_shapes_sizes_and_determinism():
    cfg = DatasetConfig(name="synthetic_fedprox", syn_alpha=0.5, syn_beta=0.5)
    ds = load_dataset(cfg, 7, 30)
    assert ds.x_train.shape[1:] == (60,) and ds.x_test.shape[1:] == (60,)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64 and ds.num_classes == 10
    assert ds.task == "classification" and ds.y_train.min() >= 0 and ds.y_train.max() <= 9
    n_tr = np.bincount(ds.client_train, minlength=30)
    n_te = np.bincount(ds.client_test, minlength=30)
    sizes = np.array(ds.meta["samples_per_device"])
    assert len(sizes) == 30 and (sizes >= 50).all()
    np.testing.assert_array_equal(n_tr, (0.9 * sizes).astype(int))  # int(0.9·n_k) train, the rest test
    np.testing.assert_array_equal(n_tr + n_te, sizes)
    assert n_tr.min() >= 45 and n_te.min() >= 5
    again = load_dataset(cfg, 7, 30)
    assert again.fingerprint() == ds.fingerprint()
    assert load_dataset(cfg, 8, 30).fingerprint() != ds.fingerprint()
    assert load_dataset(DatasetConfig(name="synthetic_fedprox", syn_alpha=1.0, syn_beta=1.0), 7, 30).fingerprint() != ds.fingerprint()
    assert len(load_dataset(DatasetConfig(name="synthetic_fedprox"), 0, None).meta["samples_per_device"]) == 100


def test_synthetic_fedprox_devices_have_their_own_labelling():
    """Every device labels by its own (W_k, b_k): with α = β = 0 the devices still differ."""
    ds = load_dataset(DatasetConfig(name="synthetic_fedprox", syn_alpha=0.0, syn_beta=0.0), 0, 10)
    majority = [np.bincount(ds.y_train[ds.client_train == k], minlength=10).argmax() for k in range(10)]
    assert len(set(majority)) > 1


def test_synthetic_fedprox_runs_fedavg_with_mclr(tmp_path):
    cfg = fedprox_cfg(partition={"num_clients": 20})
    prep = prepare(cfg, tmp_path)
    assert prep.ctx.num_clients == 20 and prep.ctx.data.input_shape == (60,)
    state = run_rounds(prep)
    hist = state.history
    assert hist[-1]["loss"] < hist[0]["loss"] and hist[-1]["accuracy"] > 0.2  # above chance (0.1)


def test_synthetic_fedprox_natural_partition_defaults_to_100_devices(tmp_path):
    prep = prepare(fedprox_cfg(train={"rounds": 1}), tmp_path)
    assert prep.ctx.num_clients == 100


def test_synthetic_fedprox_is_natural_only():
    check_natural_only("synthetic_fedprox", "natural")
    check_natural_only("digits", "iid")
    with pytest.raises(ValueError, match=r"^partition.scheme: synthetic_fedprox .* use partition.scheme=natural"):
        check_natural_only("synthetic_fedprox", "iid")


@pytest.mark.parametrize("over,needle", [
    ({"dataset": {"name": "synthetic_fedprox", "syn_alpha": -1}, "partition": {"scheme": "natural", "num_clients": None}},
     "dataset.syn_alpha"),
    ({"dataset": {"name": "synthetic_fedprox", "syn_beta": "high"}, "partition": {"scheme": "natural", "num_clients": None}},
     "dataset.syn_beta"),
    ({"dataset": {"name": "synthetic_fedprox"}, "partition": {"scheme": "dirichlet"}, "model": {"name": "mclr"}},
     "partition.scheme: synthetic_fedprox is generated device by device"),
])
def test_bad_synthetic_fedprox_settings_are_one_line_config_errors(over, needle):
    from flockfl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    assert needle in str(err.value) and "\n" not in str(err.value)
