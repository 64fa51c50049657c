"""Clustering-from-data methods (PACFL, FLIS-DC/HC, FedSC, local training): both trainers agree,
resume is bit-identical (pre-federation included), the sanity properties of the papers,
newcomers and the two evaluation conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, rel_err, tiny_config
from conftest import label_group_npz as shared_label_group_npz

from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds

NEW = [
    {"name": "pacfl", "beta": 30.0},
    {"name": "pacfl", "k": 2, "measure": "trace", "signature": "whole"},
    {"name": "flis_dc", "server_data_size": 60, "beta": 0.6},
    {"name": "flis_hc", "server_data_size": 60, "beta": 0.6},
    {"name": "fedsc", "k": 2},
    {"name": "fedsc", "k": 3, "order": "random"},
    {"name": "fedsc", "k": 2, "schedule": "simultaneous"},
    {"name": "local"},
]
IDS = [",".join(f"{k}={v}" for k, v in a.items()) for a in NEW]


def cfg_of(algo: dict, **train):
    return validate(tiny_config(algorithm=algo, train={"rounds": 4, "clients_per_round": 6, **train}))


@pytest.mark.parametrize("algo", NEW, ids=IDS)
def test_both_trainers_agree(tmp_path, algo):
    assert_trainers_agree(lambda e: cfg_of(algo, engine=e), tmp_path)


@pytest.mark.parametrize("algo", NEW, ids=IDS)
def test_resume_is_bit_identical_and_never_redoes_the_pre_federation(tmp_path, algo):
    def refuse(*_):
        raise AssertionError("the pre-federation step ran again on resume")

    def forbid(prep):
        prep.algorithm.pre_federation = refuse

    assert_resume_bit_identical(cfg_of(algo, engine="vectorized"), tmp_path, prepare_resumed=forbid)


def test_the_pre_federation_result_and_cost_are_in_the_state(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "pacfl", "beta": 30.0}), tmp_path), until=1)
    cost = state.driver.pre_federation
    # every client uploads p=3 singular vectors per class it holds, 64 floats each, as float32
    assert cost["bytes_up"] > 0 and cost["bytes_up"] % (3 * 64 * 4) == 0 and cost["bytes_down"] == 0
    prox = state.algo["matrices"]["pacfl_proximity"]
    assert prox.shape == (12, 12) and torch.allclose(prox, prox.T) and float(prox.diag().abs().max()) < 1e-6


def test_pacfl_beta_extremes_give_fedavg_and_local_training(tmp_path):
    one = run_rounds(prepare(cfg_of({"name": "pacfl", "beta": 1e6}), tmp_path), until=1)
    assert one.k == 1 and (one.assignments == 0).all()
    # whole-data signatures: 3-D subspaces of 64-D digits (per-class stacks of 10 labels span 30
    # dimensions each, and two 30-D subspaces of a 64-D space always meet: Θ_1 = 0)
    solo = run_rounds(prepare(cfg_of({"name": "pacfl", "beta": 1e-9, "signature": "whole"}), tmp_path), until=1)
    assert solo.k == 12 and sorted(solo.assignments.tolist()) == list(range(12))
    # one cluster is FedAvg: the same models, bit for bit
    fedavg = run_rounds(prepare(cfg_of({"name": "fedavg"}, engine="vectorized"), tmp_path))
    pacfl = run_rounds(prepare(cfg_of({"name": "pacfl", "beta": 1e6}, engine="vectorized"), tmp_path))
    assert all(torch.equal(pacfl.models[k], fedavg.models[k]) for k in fedavg.models)


@pytest.mark.parametrize("name", ["flis_dc", "flis_hc"])
def test_flis_beta_zero_is_fedavg_and_beta_one_separates_everyone(tmp_path, name):
    fedavg = run_rounds(prepare(validate(tiny_config(algorithm={"name": "fedavg"}, partition={"server_holdout": 60},
                                                     train={"rounds": 4, "clients_per_round": 6,
                                                            "engine": "vectorized"})), tmp_path))
    # one trainer for both: engine=auto times the trainers and may pick differently per run
    flis = run_rounds(prepare(cfg_of({"name": name, "server_data_size": 60, "beta": 0.0}, engine="vectorized"), tmp_path))
    assert flis.k == 1 and all(torch.equal(flis.models[k], fedavg.models[k]) for k in fedavg.models)
    apart = run_rounds(prepare(cfg_of({"name": name, "server_data_size": 60, "beta": 1.0}), tmp_path), until=1)
    # β = 1: a client is only with clients that predict every server sample exactly as it does
    assert apart.k >= 2


def test_fedsc_with_one_cluster_is_fedavg(tmp_path):
    fedavg = run_rounds(prepare(cfg_of({"name": "fedavg"}), tmp_path))
    fedsc = run_rounds(prepare(cfg_of({"name": "fedsc", "k": 1}), tmp_path))
    assert rel_err(fedsc.models, fedavg.models) < 1e-6


def test_fedsc_chains_through_the_clusters_in_order(tmp_path):
    prep = prepare(cfg_of({"name": "fedsc", "k": 3}, clients_per_round=2), tmp_path)
    state = run_rounds(prep, until=1)
    groups = state.algo["groups"].numpy()
    for r in range(6):
        chosen = prep.algorithm.select(state, prep.ctx, r)
        assert set(groups[chosen]) == {r % 3}


def label_group_npz(path, groups=((0, 1), (2, 3, 4), (5, 6)), per_group=4, n=24, seed=0):
    """Natural clients: group g's clients hold only the labels of groups[g] (disjoint sets)."""
    return shared_label_group_npz(path, groups, per_group, n, seed)


def test_fedsc_recovers_disjoint_label_groups(tmp_path):
    """FedSC sanity test 1: clients of 3 disjoint label groups are recovered exactly (complete
    linkage on the label-proportion vectors, cut at 3 clusters)."""
    from sklearn.metrics import adjusted_rand_score

    truth = label_group_npz(tmp_path / "groups.npz")
    cfg = validate({"dataset": {"name": "npz", "path": str(tmp_path / "groups.npz")}, "partition": {"scheme": "natural"},
                    "model": {"name": "mclr"}, "algorithm": {"name": "fedsc", "k": 3},
                    "train": {"rounds": 1, "clients_per_round": 4}, "tracking": {"enabled": False}})
    state = run_rounds(prepare(cfg, tmp_path), until=1)
    assert adjusted_rand_score(truth, state.algo["groups"].numpy()) == 1.0


def test_local_training_never_communicates_and_keeps_models_apart(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "local"}), tmp_path))
    assert state.k == 12 and all(h["bytes_total"] == 0 for h in state.history)
    trained = np.unique(np.concatenate([np.flatnonzero(row >= 0) for row in state.assignment_history]))
    assert len(trained) == 12


def test_both_evaluation_conventions_are_logged(tmp_path):
    row = run_rounds(prepare(cfg_of({"name": "fedavg"}), tmp_path)).history[-1]
    for key in ("accuracy", "accuracy_p10", "accuracy_finetuned", "accuracy_finetuned_p10", "loss_finetuned"):
        assert key in row, key
    # after local training on its own (rotated) data a client fits it at least as well as the global model
    assert row["accuracy_finetuned"] > row["accuracy"] - 0.05


@pytest.mark.parametrize("algo", [{"name": "fedavg"}, {"name": "ifca", "k": 2}, {"name": "pacfl", "beta": 30.0},
                                  {"name": "pacfl", "beta": 30.0, "newcomer_mode": "recluster"},
                                  {"name": "flis_dc", "server_data_size": 60, "beta": 0.5},
                                  {"name": "flis_hc", "server_data_size": 60, "beta": 0.5},
                                  {"name": "local"}],
                         ids=["fedavg", "ifca", "pacfl", "pacfl-recluster", "flis_dc", "flis_hc", "local"])
def test_newcomers_join_after_training(tmp_path, algo):
    cfg = validate(tiny_config(algorithm=algo, partition={"unseen_fraction": 0.25},
                               train={"rounds": 3, "clients_per_round": 6, "finetune_epochs": 2}))
    prep = prepare(cfg, tmp_path)
    unseen = prep.ctx.unseen
    assert len(unseen) == 3
    state = run_rounds(prep)
    # newcomers never trained: they are in no round's cohort
    trained = set()
    for r in range(3):
        trained |= set(prep.algorithm.select(state, prep.ctx, r).tolist())
    assert not trained & set(unseen.tolist())
    row = state.history[-1]
    assert 0.0 <= row["unseen_accuracy"] <= 1.0 and "unseen_accuracy_untuned" in row
    info = state.driver.newcomers
    assert info["clients"] == unseen.tolist() and len(info["clusters"]) == 3 and info["rule"]


def test_the_fine_tuned_evaluation_in_smaller_chunks_gives_the_same_numbers(tmp_path):
    """train.finetune_chunk_mb bounds the fine-tuned models held at once (fewer clients a chunk for
    large models); how the clients are chunked changes no number."""
    from flockfl.rounds import finetune_chunk

    cfg = cfg_of({"name": "ifca", "k": 2, "init": "random"})
    state = run_rounds(prepare(cfg, tmp_path / "a"))
    row_bytes = sum(v[0].numel() * v.element_size() for v in state.models.values())
    tiny = validate({**cfg.model_dump(), "train": {**cfg.train.model_dump(), "finetune_chunk_mb": 2.5 * row_bytes / 2**20}})
    assert finetune_chunk(state, cfg) == cfg.train.eval_chunk and finetune_chunk(state, tiny) == 2
    small = run_rounds(prepare(tiny, tmp_path / "b"))
    keys = [k for k in state.history[-1] if "finetuned" in k]
    assert keys and all(state.history[-1][k] == small.history[-1][k] for k in keys)
    assert small.digest() == state.digest()
