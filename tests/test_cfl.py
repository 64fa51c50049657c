"""CFL (Sattler et al., arXiv 1910.01991): both trainers agree and resume is bit-identical across
splits; ε₂ out of reach is uniform FedAvg; IID digits never split while label-swapped digits split
into their 4 groups, first when the stationarity criterion held; the bi-partitions (single
linkage = the brute-force min-max, complete = sklearn's); the γ check; one-line errors for every
key; `flockfl list cfl`."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, tiny_config

from flockfl.clustering.bipartition import bipartition, cosine_similarities, cross_max
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds

# ε₁ = ∞, ε₂ = 0: every cluster with ≥ 3 trained members splits once the warm-up is over
ALWAYS = {"name": "cfl", "eps1": 1e9, "eps2": 0.0, "warmup_rounds": 1}


def cfg_of(algo: dict, partition: dict | None = None, **train):
    return validate(tiny_config(algorithm=algo, partition=partition or {},
                                train={"rounds": 4, "clients_per_round": 6, **train}))


def test_both_trainers_agree_across_splits(tmp_path):
    algo = {**ALWAYS, "weighting": "samples"}
    ref, vec = assert_trainers_agree(lambda e: cfg_of(algo, {"unseen_fraction": 0.2}, engine=e), tmp_path)
    tree = [[(r["round"], r["children"], r["sizes"]) for r in s.meta["cfl_splits"]] for s in (ref, vec)]
    assert vec.k > 2 and tree[0] == tree[1]
    assert vec.driver.newcomers["rule"] == "the lowest-loss cluster model"


def test_resume_continues_the_cluster_tree_bit_identically(tmp_path):
    cfg = cfg_of({**ALWAYS, "linkage": "single"}, engine="vectorized")
    full, resumed = assert_resume_bit_identical(cfg, tmp_path, until=2)
    assert resumed.meta["cfl_splits"] == full.meta["cfl_splits"]
    rounds = {r["round"] for r in full.meta["cfl_splits"]}
    assert {1, 3} <= rounds  # a split before the checkpoint and one after it
    parent, born = full.algo["cfl_parent"].tolist(), full.algo["cfl_born"].tolist()
    assert len(parent) == full.k and parent[0] == -1 and born[0] == -1
    for r in full.meta["cfl_splits"]:  # the tree: each split's child points at its parent, born that round
        c, child = r["children"]
        assert c == r["parent"] and parent[child] == c and born[child] == r["round"]
        assert r["gamma_bound"] == pytest.approx(np.sqrt((1 - r["alpha_cross_max"]) / 2))
    # partial participation: clients that missed their cluster's split round stay in c₁ and are counted
    assert sum(h["cfl_unplaced"] for h in full.history) > 0
    assert [h["cfl_splits"] for h in full.history][0] == 0  # not before the warm-up


def test_unreachable_eps2_is_uniform_fedavg_bit_for_bit(tmp_path):
    cfl = run_rounds(prepare(cfg_of({"name": "cfl", "eps2": 1e9, "warmup_rounds": 0}), tmp_path))
    fedavg = run_rounds(prepare(cfg_of({"name": "fedavg", "weighting": "uniform"}), tmp_path))
    assert cfl.k == 1 and all(torch.equal(cfl.models[k], fedavg.models[k]) for k in fedavg.models)
    # γ_max = 0.99 refuses every split the ε tests allow, and counts it
    refused = run_rounds(prepare(cfg_of({**ALWAYS, "gamma_max": 0.99}), tmp_path))
    assert refused.k == 1 and sum(h["cfl_refused"] for h in refused.history) == 3


# digits, 32 clients all training every round; ε₁, ε₂ chosen for this MLP (its update norms)
SPLITS = {"name": "cfl", "eps1": 0.3, "eps2": 0.95, "warmup_rounds": 0}


def digits_run(tmp_path, partition: dict):
    cfg = validate(tiny_config(algorithm=SPLITS, partition={"num_clients": 32, **partition},
                               train={"rounds": 24, "clients_per_round": 32, "lr": 0.3, "local_epochs": 2}))
    return run_rounds(prepare(cfg, tmp_path))


def test_iid_digits_never_split(tmp_path):
    state = digits_run(tmp_path, {"scheme": "iid"})
    assert state.k == 1 and state.meta["cfl_splits"] == []
    assert any(h["cfl_mean_update_norm"] < SPLITS["eps1"] for h in state.history)  # stationary, yet no divergence


def test_label_swapped_digits_split_into_their_groups_once_stationary(tmp_path):
    state = digits_run(tmp_path, {"scheme": "label_swap", "k": 4, "label_swap_mode": "random_perm"})
    assert state.k == 4 and state.history[-1]["ari"] >= 0.95
    first = state.meta["cfl_splits"][0]["round"]
    met = [h["cfl_mean_update_norm"] < SPLITS["eps1"] and h["cfl_max_update_norm"] > SPLITS["eps2"]
           for h in state.history]
    assert met.index(True) == first and state.history[first]["cfl_splits"] == 1  # the first round it held
    print(f"first split in round {first} (0-based), final ARI {state.history[-1]['ari']:.3f}, "
          f"splits {[r['round'] for r in state.meta['cfl_splits']]}")


def brute_force_min_max(sim: np.ndarray) -> float:
    n = len(sim)
    best = np.inf
    for mask in itertools.product([0, 1], repeat=n - 1):
        labels = np.array((0,) + mask)
        if labels.any():
            best = min(best, cross_max(sim, labels))
    return best


def test_bipartitions_single_is_the_exact_min_max_and_complete_is_sklearns():
    from sklearn.cluster import AgglomerativeClustering

    rng = np.random.default_rng(0)
    for n in (3, 5, 8, 10):
        for _ in range(5):
            sim = cosine_similarities(rng.normal(size=(n, 4)))
            assert np.array_equal(sim, sim.T) and np.all(np.diag(sim) == 1.0)
            assert cross_max(sim, bipartition(sim, "single")) == pytest.approx(brute_force_min_max(sim))
            ours = bipartition(sim, "complete")
            theirs = AgglomerativeClustering(metric="precomputed", linkage="complete").fit(-sim).labels_
            assert np.array_equal(ours, theirs) or np.array_equal(ours, 1 - theirs)
    assert cosine_similarities(np.array([[0.0, 0.0], [1.0, 0.0]]))[0, 1] == 0.0  # a zero update: similarity 0


BAD = [("eps1", 0), ("eps1", "small"), ("eps2", -1.0), ("gamma_max", 1.0), ("gamma_max", -0.1),
       ("linkage", "average"), ("warmup_rounds", -1), ("warmup_rounds", 1.5), ("min_split_size", 1),
       ("weighting", "clients")]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_bad_values_are_one_line_errors(key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "cfl", key: value}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}: {value!r} is not allowed for cfl; allowed: ") and "\n" not in msg


def test_flock_list_shows_the_paper_and_keys(capsys):
    from flows.cli import main

    assert main(["list", "cfl", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "1910.01991" in d["paper"] and {"aggregate", "model_of", "eval_assignment", "admit_newcomers"} <= set(d["stages"])
    keys = {h["key"]: h for h in d["hyperparameters"]}
    assert keys["algorithm.eps1"]["default"] == 0.4 and keys["algorithm.eps2"]["default"] == 1.6
    assert keys["algorithm.gamma_max"]["default"] is None and keys["algorithm.linkage"]["default"] == "complete"
    assert keys["algorithm.eps1"]["symbol"] == "ε₁" and keys["algorithm.warmup_rounds"]["default"] == 20


# ---------------------------------------------------------------------- cfl-pacfl (update_pool=stale_all)


def test_stale_all_with_full_participation_is_the_participants_rule(tmp_path):
    """With every client training every round, every member's latest update is this round's:
    the two pools give the same clusters and (to float rounding) the same models."""
    parts = run_rounds(prepare(cfg_of(ALWAYS, clients_per_round=12), tmp_path))
    stale = run_rounds(prepare(cfg_of({**ALWAYS, "update_pool": "stale_all"}, clients_per_round=12), tmp_path))
    assert parts.k == stale.k > 1
    assert np.array_equal(parts.assignments, stale.assignments)
    for k in parts.models:
        assert torch.allclose(parts.models[k], stale.models[k], atol=1e-5), k


def test_stale_all_reapplies_a_stale_update_until_its_client_trains_again(tmp_path):
    """The thesis code's quirk, kept: after round 1 the cluster model has moved by the mean over
    every member of its latest Δθ, i.e. the rows the table holds then: round 1's for its cohort,
    round 0's (stale, applied a second time) for the rest of round 0's cohort, zero for the others."""
    from flockfl.aggregation import flatten

    def prep(rounds):
        return prepare(cfg_of({"name": "cfl-pacfl", "eps2": 1e9}, rounds=rounds, clients_per_round=4), tmp_path)

    first = prep(1)
    one, two = run_rounds(first), run_rounds(prep(2))
    table = two.algo["cfl_delta"]
    assert 4 < table.written().sum() < 8  # two cohorts of 4 that overlap partly
    names = first.algorithm.trainable(first.ctx)
    step = flatten({k: two.models[k] for k in names})[0] - flatten({k: one.models[k] for k in names})[0]
    torch.testing.assert_close(step, table.dense()["d"].mean(0), atol=1e-6, rtol=1e-4)


def test_stale_all_one_round_is_the_mean_over_every_member(tmp_path):
    """Round 0 by hand: members that did not train count as zero updates, so the cluster model
    moves by (Σ over the cohort of Δθ_i) / N under uniform weights."""
    from flockfl.aggregation import flatten

    cfg = cfg_of({"name": "cfl-pacfl", "eps2": 1e9}, rounds=1, clients_per_round=4)
    prep = prepare(cfg, tmp_path)
    s0 = prep.algorithm.init_state(prep.ctx)
    fedavg = run_rounds(prepare(cfg_of({"name": "fedavg", "weighting": "uniform"}, rounds=1, clients_per_round=4),
                                tmp_path))
    stale = run_rounds(prep)
    names = prep.algorithm.trainable(prep.ctx)
    n = len(prep.ctx.seen)
    theta0 = flatten({k: s0.models[k] for k in names})[0]
    step_fedavg = flatten({k: fedavg.models[k] for k in names})[0] - theta0
    step_stale = flatten({k: stale.models[k] for k in names})[0] - theta0
    torch.testing.assert_close(step_stale, step_fedavg * 4 / n, atol=1e-6, rtol=1e-4)


def test_cfl_pacfl_defaults_and_both_trainers(tmp_path):
    from flockfl.algorithms import ALGORITHMS

    hp = {h.name: h.default for h in ALGORITHMS["cfl-pacfl"].hyperparameters}
    assert hp["update_pool"] == "stale_all" and hp["warmup_rounds"] == 21 and hp["eps1"] == 0.4 and hp["eps2"] == 1.6
    algo = {"name": "cfl-pacfl", "eps1": 1e9, "eps2": 0.0, "warmup_rounds": 1}
    ref, vec = assert_trainers_agree(lambda e: cfg_of(algo, engine=e), tmp_path)
    assert vec.k > 1 and np.array_equal(ref.assignments, vec.assignments)
    cfg = cfg_of(algo, engine="vectorized")
    full, resumed = assert_resume_bit_identical(cfg, tmp_path, until=2)
    assert resumed.meta["cfl_splits"] == full.meta["cfl_splits"]
