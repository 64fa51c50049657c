"""Regression tests of issue 19 ("bugs found on the way"):

1. the round's distribution shift and the client curriculum run once per round, not once per
   cycle of a multi-cycle algorithm (FedCluster), also when a run resumes mid-round;
2. a client is charged for the models it downloaded (FLIS-DC's T_t), not the post-aggregation k;
3. IFCA option I divides by the m workers that federate, not by a population with newcomers;
4. a data curriculum under an algorithm that trains on full batches is refused, never a
   silent no-op with ``difficulty_std`` logged;
5. hybrid pruning decides the channel mask and the weight mask independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_mid_round_resume, tiny_config

from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rounds import PLAIN, Stages, drive, prepare, run_rounds, select_stage
from flockfl.state import load_latest, save_checkpoint


def cfg_of(algo=None, **over):
    from flockfl.config import deep_merge

    base = {"algorithm": algo or {"name": "fedavg"}, "partition": {"scheme": "dirichlet", "alpha": 0.3},
            "train": {"rounds": 3, "clients_per_round": 6, "engine": "vectorized"}}
    return validate(tiny_config(**deep_merge(base, over)))


def owners_by_round(cfg, root) -> tuple[list[np.ndarray], list]:
    """The training-sample owners after every round, and the history."""
    owners = []
    st = run_rounds(prepare(cfg, root), on_round=lambda s, row: owners.append(s.algo["shift"]["train_owner"].numpy().copy()))
    return owners, st.history


# ---------------------------------------------------------------------- 1. once per round, not per cycle


@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("p", [1.0, 0.5])
def test_the_shift_happens_once_per_round_under_fedcluster_cycles(tmp_path, m, p):
    """FedCluster's M cycles see one shift per round: the same owners, round by round, as a
    one-cycle algorithm (the shift's draw is (seed, round) only), and the same counts."""
    sh = {"shift": {"kind": "swap_all", "probability": p}}
    fc_owners, fc_hist = owners_by_round(cfg_of({"name": "fedcluster", "k": m}, **sh), tmp_path)
    avg_owners, avg_hist = owners_by_round(cfg_of({"name": "fedavg"}, **sh), tmp_path)
    for r, (a, b) in enumerate(zip(fc_owners, avg_owners)):
        assert np.array_equal(a, b), f"round {r}: the data FedCluster trained on after the shift differs"
    assert [h["clients_shifted"] for h in fc_hist] == [h["clients_shifted"] for h in avg_hist]
    if p == 1.0:  # 12 clients, 6 pairs, every pair swaps once per round
        assert all(h["clients_shifted"] == 12 for h in fc_hist)
        assert not np.array_equal(fc_owners[0], np.sort(fc_owners[0]))  # round 0 really moved the data


def test_a_mid_round_resume_does_not_shift_again(tmp_path):
    cfg = cfg_of({"name": "fedcluster", "k": 3}, shift={"kind": "swap_all", "probability": 1.0})
    full = run_rounds(prepare(cfg, tmp_path))
    mids = []
    drive(prepare(cfg, tmp_path), None, PLAIN, until=2, on_cycle=mids.append)
    for cycle in (1, 2):
        mid = [s for s in mids if s.round == 1 and s.driver.partial_round["cycle"] == cycle][0]
        save_checkpoint(mid, tmp_path / f"run{cycle}")
        restored, _ = load_latest(tmp_path / f"run{cycle}")
        resumed = drive(prepare(cfg, tmp_path), restored, PLAIN)
        assert resumed.digest() == full.digest()
        assert [h["clients_shifted"] for h in resumed.history] == [12, 12, 12]
    avg, _ = owners_by_round(cfg_of({"name": "fedavg"}, shift={"kind": "swap_all", "probability": 1.0}), tmp_path)
    assert np.array_equal(full.algo["shift"]["train_owner"].numpy(), avg[-1])


def test_the_client_curriculum_selects_once_per_round_and_fedcluster_cycles_split_it(tmp_path):
    cfg = cfg_of({"name": "fedcluster", "k": 2}, curriculum={"clients": True, "b": 0.5}, train={"rounds": 4})
    prep = prepare(cfg, tmp_path)
    cur = prep.stages["curriculum"]
    cohorts, orig = [], cur.cohort

    def cohort(ctx, state, alg, round):
        out = orig(ctx, state, alg, round)
        cohorts.append((round, out[0].copy()))
        return out

    cur.cohort = cohort
    cycles = []

    def select(prep_, state, round):
        state, spec = select_stage(prep_, state, round)
        cycles.append((round, state.driver.cycle, spec.clients.copy()))
        return state, spec

    st = drive(prep, None, Stages(select=select))
    clusters = prep.algorithm.clusters(prep.ctx)
    assert [r for r, _ in cohorts] == [0, 1, 2, 3]  # the curriculum draws once per round
    for r, want in cohorts:
        mine = [(c, cl) for rr, c, cl in cycles if rr == r]
        assert [c for c, _ in mine] == [0, 1]
        trained = np.concatenate([cl for _, cl in mine])
        assert len(trained) == len(set(trained.tolist()))  # every client at most once per round
        assert sorted(trained.tolist()) == sorted(want.tolist())  # the cycles split the curriculum's cohort
        order = prep.algorithm.order(st, prep.ctx, r)
        for c, cl in mine:  # cycle c trains the cohort's members of FedCluster's cluster σ_r(c)
            assert (clusters[cl] == order[c]).all()
    assert [h["clients"] for h in st.history] == [len(w) for _, w in cohorts]
    assert [h["client_pool"] for h in st.history] == [6, 8, 10, 12]  # logged once per round, not per cycle
    assert st.driver.round_cohort is None


def test_a_mid_round_resume_keeps_the_rounds_cohort(tmp_path):
    cfg = cfg_of({"name": "fedcluster", "k": 3}, curriculum={"clients": True, "ordering": "curr", "b": 0.5},
                 shift={"kind": "swap_all", "probability": 0.5})
    mid = assert_mid_round_resume(cfg, tmp_path, round=1, cycle=2)
    assert mid.driver.round_cohort is not None


def test_means_logged_by_stages_are_means_over_the_rounds_cycles(tmp_path):
    """A data curriculum's difficulty_std is the mean over the round's cohort, not a sum over cycles."""
    cfg = cfg_of({"name": "fedcluster", "k": 3}, curriculum={"ordering": "curr"})
    prep = prepare(cfg, tmp_path)
    cur = prep.stages["curriculum"]
    stds, orig = [], cur.apply

    def apply(ctx, state, spec, round):
        out = orig(ctx, state, spec, round)
        stds.append((round, len(spec.clients), out[1]["difficulty_std"]))
        return out

    cur.apply = apply
    st = run_rounds(prep)
    for r, h in enumerate(st.history):
        parts = [(n, s) for rr, n, s in stds if rr == r]
        assert len(parts) == 3
        want = sum(n * s for n, s in parts) / sum(n for n, _ in parts)
        assert h["difficulty_std"] == pytest.approx(want, rel=1e-12)
        assert not any(k.startswith("_") for k in h)


# ---------------------------------------------------------------------- 2. bytes of what was downloaded


def test_flis_dc_charges_the_models_the_cohort_downloaded(tmp_path):
    cfg = cfg_of({"name": "flis_dc", "server_data_size": 100, "beta": 1.0})  # β = 1: every participant its own cluster
    prep = prepare(cfg, tmp_path)
    ks = [prep.algorithm.init_state(prep.ctx).k]
    st = run_rounds(prep, on_round=lambda s, row: ks.append(s.k))
    per_model = prep.algorithm.model_bytes(st)
    assert ks[1] > ks[0]  # the number of cluster models changes, so the two readings differ
    for r, h in enumerate(st.history):
        assert h["bytes_down"] == h["clients"] * per_model * ks[r], (r, ks)  # T_t models of the state it received
        assert h["bytes_up"] == h["clients"] * per_model


# ---------------------------------------------------------------------- 3. IFCA option I's m


def test_ifca_gradient_averaging_divides_by_the_workers_that_federate(tmp_path):
    cfg = cfg_of({"name": "ifca", "k": 2, "init": "random", "option": "gradient"},
                 partition={"unseen_fraction": 0.25}, train={"rounds": 1})
    prep = prepare(cfg, tmp_path)
    calls, orig = [], prep.algorithm.aggregate

    def aggregate(state, ctx, spec, result, assign):
        new = orig(state, ctx, spec, result, assign)
        calls.append((state, result, assign, new))
        return new

    prep.algorithm.aggregate = aggregate
    run_rounds(prep)
    (state, result, assign, new), = calls
    m = len(prep.ctx.seen)
    assert m < prep.ctx.num_clients  # newcomers exist and never train
    for j in range(2):
        members = np.flatnonzero(assign == j)
        for k, v in state.models.items():
            step = (v[j].unsqueeze(0).double() - result.params[k][members].double()).sum(0)
            torch.testing.assert_close(new.models[k][j].double(), v[j].double() - step / m, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- 4. full batches and a data curriculum


@pytest.mark.parametrize("over,needle", [
    ({"train": {"full_batch": True}}, "train.full_batch"),
    ({"algorithm": {"name": "ifca", "k": 2, "init": "random", "option": "gradient"}}, "algorithm.option"),
], ids=["train.full_batch", "ifca-option-I"])
def test_a_data_curriculum_on_full_batches_is_refused_when_validated(over, needle):
    with pytest.raises(ConfigError) as err:
        cfg_of(**over, curriculum={"ordering": "curr"})
    assert needle in str(err.value) and "\n" not in str(err.value)


LINREG = {"dataset": {"name": "synthetic_linreg", "clusters": 2, "dim": 10, "samples_per_client": 40},
          "partition": {"scheme": "natural", "num_clients": 12}, "model": {"name": "linear"}}


@pytest.mark.parametrize("algo,over", [({"name": "fedsgd"}, {}), ({"name": "fedsplit", "prox": "exact"}, LINREG)],
                         ids=["fedsgd", "fedsplit-exact"])
def test_a_data_curriculum_under_an_algorithm_that_trains_on_full_batches_is_refused(tmp_path, algo, over):
    """FedSGD's one full-batch step (FedSplit's closed-form prox) has no mini-batches to pace:
    refused (one line, naming the fix) before any client trains, never a run that logs
    difficulty_std as if the curriculum were applied."""
    prep = prepare(cfg_of(algo, curriculum={"ordering": "curr"}, **over), tmp_path)

    def aggregate(*_):
        raise AssertionError("clients trained under a curriculum that was not applied")

    prep.algorithm.aggregate = aggregate
    with pytest.raises(ConfigError) as err:
        run_rounds(prep)
    msg = str(err.value)
    assert "curriculum.ordering" in msg and "vanilla" in msg and "\n" not in msg


def test_a_client_curriculum_alone_runs_on_full_batches(tmp_path):
    st = run_rounds(prepare(cfg_of({"name": "fedsgd"}, curriculum={"clients": True}), tmp_path))
    assert all("client_pool" in h and "difficulty_std" not in h for h in st.history)


# ---------------------------------------------------------------------- 5. hybrid pruning, two decisions


@pytest.mark.parametrize("harmful", ["channels", "weights"])
def test_hybrid_pruning_decides_each_mask_on_its_own(tmp_path, harmful):
    """A (simulated) accuracy that collapses when one kind of mask prunes: the other mask is still
    applied (Algorithm 11 and the authors' code decide them independently)."""
    cfg = validate(tiny_config(
        model={"name": "cnn_bn", "hidden": 16}, partition={"scheme": "dirichlet", "alpha": 0.5, "num_clients": 8},
        pruning={"method": "hybrid", "acc_threshold": 0.5, "mask_threshold": 0.0, "channel_threshold": 0.0},
        train={"rounds": 1, "clients_per_round": 4, "batch_size": 16, "eval_finetune": "off", "threads": 1}))
    prep = prepare(cfg, tmp_path)
    pr = prep.stages["pruning"]
    bns = [g["bn"] for g in pr.groups]
    last_fc = [k for k in pr.unstructured if not any(k.startswith(g["consumer"] + ".") for g in pr.groups)]
    assert bns and last_fc

    def accuracy(ctx, params, clients):
        n = len(clients)
        if harmful == "channels":  # a pruned channel has γ = 0
            bad = np.array([any(bool((params[f"{b}.weight"][i] == 0).any()) for b in bns) for i in range(n)])
        else:  # a weight of a layer no channel feeds
            bad = np.array([any(bool((params[k][i] == 0).any()) for k in last_fc) for i in range(n)])
        return np.zeros(n), np.where(bad, 0.0, 1.0), np.ones(n)

    pr.subnet_metrics = accuracy
    st = run_rounds(prep)
    w, ch = pr.rows(st, np.arange(8))
    weights_pruned = sum(int((~v).sum()) for v in w.values())
    channels_pruned = sum(int((~v).sum()) for v in ch.values())
    if harmful == "channels":
        assert channels_pruned == 0 and weights_pruned > 0
    else:
        assert weights_pruned == 0 and channels_pruned > 0
    assert st.history[0]["clients_pruned"] == 4
