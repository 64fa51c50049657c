"""Client-level distribution shift (FlexCFL §3) for every algorithm, and FedCluster's cycles
(spec §3.1): the union of the data never changes, shifts are deterministic and in the state,
resume is bit-identical mid-shift and mid-cycle, FedCluster(M=1) is FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_mid_round_resume, tiny_config

from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.stages import shift
from flockfl.rounds import PLAIN, drive, prepare, run_rounds
from flockfl.state import load_latest, save_checkpoint


def cfg_of(algo=None, shift_cfg=None, partition=None, **train):
    return validate(tiny_config(algorithm=algo or {"name": "fedavg"}, shift=shift_cfg or {"kind": "none"},
                                partition=partition or {"scheme": "dirichlet", "alpha": 0.3},
                                train={"rounds": 6, "clients_per_round": 6, "engine": "vectorized", **train}))


SHIFTS = [{"kind": "swap_all", "probability": 0.5}, {"kind": "swap_part", "probability": 0.5},
          {"kind": "swap_part", "probability": 0.5, "mode": "code_faithful"},
          {"kind": "incremental", "every": 2}, {"kind": "incremental", "every": 2, "mode": "code_faithful"}]
SHIFT_IDS = [",".join(f"{k}={v}" for k, v in s.items()) for s in SHIFTS]


@pytest.mark.parametrize("sh", SHIFTS, ids=SHIFT_IDS)
def test_a_shift_moves_data_but_never_changes_its_union(tmp_path, sh):
    prep = prepare(cfg_of(shift_cfg=sh), tmp_path)
    state = run_rounds(prep)
    shifted = [h["clients_shifted"] for h in state.history]
    assert sum(shifted) > 0, shifted
    own = state.algo["shift"]
    base = prep.ctx.base_data
    # every sample has exactly one owner, a real client; the view is exactly what the owners say
    assert own["train_owner"].shape[0] == base.train.offsets[-1] and own["test_owner"].shape[0] == base.test.offsets[-1]
    assert own["train_owner"].min() >= 0 and own["train_owner"].max() < base.num_clients
    if sh["kind"] == "incremental":
        assert prep.ctx.data.train.offsets[-1] < base.train.offsets[-1]  # not everything released yet
        assert torch.equal(own["train_owner"], torch.from_numpy(shift.owners_of(base.train)))  # nobody swapped
    else:
        assert shift.union_check(base, prep.ctx.data)
        assert not torch.equal(own["train_owner"], torch.from_numpy(shift.owners_of(base.train)))


def test_swap_all_exchanges_whole_datasets_and_groups_follow_the_data(tmp_path):
    cfg = cfg_of(shift_cfg={"kind": "swap_all", "probability": 1.0}, partition={"scheme": "rotated", "k": 2}, rounds=1)
    prep = prepare(cfg, tmp_path)
    base = prep.ctx.base_data
    state = run_rounds(prep)
    data = prep.ctx.data
    assert state.history[0]["clients_shifted"] == 12  # 12 clients, 6 pairs, all swap
    owner = state.algo["shift"]["train_owner"].numpy()
    for c in range(base.num_clients):
        src = int(np.unique(owner[base.train.offsets[c]:base.train.offsets[c + 1]])[0])  # c's data went to src
        x, _ = data.train.client(src)
        assert torch.equal(x, base.train.client(c)[0])
        assert data.group[src] == base.group[c]  # the ground truth moves with the data
    assert state.history[0]["ari"] == pytest.approx(1.0) or "ari" in state.history[0]


def test_swap_part_moves_one_exclusive_label_each_way(tmp_path):
    cfg = cfg_of(shift_cfg={"kind": "swap_part", "probability": 1.0}, partition={"scheme": "shards", "classes_per_client": 2},
                 rounds=1)
    prep = prepare(cfg, tmp_path)
    base = prep.ctx.base_data
    run_rounds(prep)
    labels = lambda d, c: set(d.train.client(c)[1].tolist())  # noqa: E731
    changed = [c for c in range(base.num_clients) if labels(base, c) != labels(prep.ctx.data, c)]
    assert changed and shift.union_check(base, prep.ctx.data)
    for c in changed:  # lost one label it had, gained one it lacked
        assert len(labels(base, c) - labels(prep.ctx.data, c)) == 1 and len(labels(prep.ctx.data, c) - labels(base, c)) == 1


def test_incremental_releases_a_quarter_more_every_period_and_code_faithful_shrinks():
    cfg = validate(tiny_config(shift={"kind": "incremental"}))
    sizes = np.array([100, 7])
    assert [shift.released_sizes(cfg, sizes, lv).tolist() for lv in range(5)] == [[25, 2], [50, 4], [75, 6], [100, 7], [100, 7]]
    faithful = validate(tiny_config(shift={"kind": "incremental", "mode": "code_faithful"}))
    assert [shift.released_sizes(faithful, np.array([320]), lv).tolist() for lv in range(4)] == [[80], [40], [30], [30]]
    assert [shift.release_level(cfg, r) for r in (0, 49, 50, 149, 150)] == [0, 0, 1, 2, 3]


def test_the_shift_is_deterministic_and_starts_at_start_round(tmp_path):
    sh = {"kind": "swap_all", "probability": 0.5, "start_round": 3}
    a = run_rounds(prepare(cfg_of(shift_cfg=sh), tmp_path))
    b = run_rounds(prepare(cfg_of(shift_cfg=sh), tmp_path))
    assert a.digest() == b.digest()
    assert [h["clients_shifted"] for h in a.history][:3] == [0, 0, 0] and sum(h["clients_shifted"] for h in a.history) > 0
    assert a.digest() != run_rounds(prepare(cfg_of(shift_cfg={**sh, "start_round": 4}), tmp_path)).digest()


@pytest.mark.parametrize("algo", [{"name": "fedavg"}, {"name": "ifca", "k": 2}, {"name": "fedcluster", "k": 3}],
                         ids=["fedavg", "ifca", "fedcluster"])
@pytest.mark.parametrize("sh", SHIFTS[:2] + SHIFTS[3:4], ids=SHIFT_IDS[:2] + SHIFT_IDS[3:4])
def test_resume_in_the_middle_of_a_shifting_run_is_bit_identical(tmp_path, algo, sh):
    cfg = cfg_of(algo, sh)
    full = run_rounds(prepare(cfg, tmp_path))
    half = run_rounds(prepare(cfg, tmp_path), until=3)
    save_checkpoint(half, tmp_path / "run")
    restored, _ = load_latest(tmp_path / "run")
    resumed = drive(prepare(cfg, tmp_path), restored, PLAIN)  # a fresh context: the view is rebuilt from the state
    assert resumed.digest() == full.digest()
    assert [h.get("clients_shifted") for h in resumed.history] == [h.get("clients_shifted") for h in full.history]
    assert [h["accuracy"] for h in resumed.history] == [h["accuracy"] for h in full.history]


@pytest.mark.parametrize("over,needle", [
    ({"kind": "swap_some"}, "shift.kind"), ({"probability": 1.5}, "shift.probability"),
    ({"start_round": -1}, "shift.start_round"), ({"release": 0}, "shift.release"), ({"every": 0}, "shift.every"),
    ({"mode": "faithful"}, "shift.mode"), ({"bogus": 1}, "unknown key 'shift.bogus'"),
])
def test_bad_shift_keys_are_one_line_errors(over, needle):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(shift=over))
    assert needle in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------- FedCluster


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedcluster_with_one_cluster_is_fedavg(tmp_path, weighting):
    fedavg = run_rounds(prepare(cfg_of({"name": "fedavg", "weighting": weighting}), tmp_path))
    fc = run_rounds(prepare(cfg_of({"name": "fedcluster", "k": 1, "weighting": weighting}), tmp_path))
    assert fc.digest() == fedavg.digest()


def test_fedcluster_makes_m_updates_per_round_each_client_at_most_once(tmp_path):
    prep = prepare(cfg_of({"name": "fedcluster", "k": 3, "per_cycle": 2}), tmp_path)
    seen = []
    orig = prep.algorithm.aggregate

    def counting(state, ctx, spec, result, assign):
        seen.append((state.driver.cycle, result.clients.tolist()))
        return orig(state, ctx, spec, result, assign)

    prep.algorithm.aggregate = counting
    state = drive(prep, None, PLAIN, until=2)
    clusters = prep.algorithm.clusters(prep.ctx)
    assert [c for c, _ in seen] == [0, 1, 2, 0, 1, 2]
    for r in range(2):
        cycles = seen[3 * r: 3 * r + 3]
        members = [m for _, ms in cycles for m in ms]
        assert len(members) == len(set(members)) == 6  # every client at most once per round
        assert sorted(int(np.unique(clusters[ms])[0]) for _, ms in cycles) == [0, 1, 2]  # one cluster per cycle
    assert state.history[0]["clients"] == 6 and "cycle" not in state.meta and "partial_round" not in state.meta


def test_fedcluster_fixed_order_visits_clusters_by_index_and_random_order_permutes(tmp_path):
    def orders(order):
        prep = prepare(cfg_of({"name": "fedcluster", "k": 4, "cluster_order": order}), tmp_path)
        st = prep.algorithm.init_state(prep.ctx)
        return [prep.algorithm.order(st, prep.ctx, r).tolist() for r in range(5)]

    assert orders("fixed") == [[0, 1, 2, 3]] * 5
    rnd = orders("random_permutation")
    assert all(sorted(o) == [0, 1, 2, 3] for o in rnd) and len({tuple(o) for o in rnd}) > 1


def test_fedcluster_resumes_mid_round_bit_identically(tmp_path):
    cfg = cfg_of({"name": "fedcluster", "k": 3}, rounds=3)
    assert_mid_round_resume(cfg, tmp_path, round=1, cycle=2)  # round 2, two cycles done


def test_fedcluster_trainers_agree(tmp_path):
    ref = run_rounds(prepare(cfg_of({"name": "fedcluster", "k": 2}, engine="reference", rounds=3), tmp_path))
    vec = run_rounds(prepare(cfg_of({"name": "fedcluster", "k": 2}, engine="vectorized", rounds=3), tmp_path))
    assert max(float((vec.models[k] - ref.models[k]).norm() / ref.models[k].norm()) for k in ref.models) < 1e-5


def test_fedcluster_cluster_mass_weights_follow_the_paper(tmp_path):
    """p_k/q_m: with the whole cluster sampled it is the sampled normalisation; with a sample
    the weights sum to less than 1, and the model differs."""
    def run(normalize, per_cycle):
        return run_rounds(prepare(cfg_of({"name": "fedcluster", "k": 2, "normalize": normalize, "per_cycle": per_cycle},
                                         rounds=2), tmp_path))

    assert run("cluster_mass", 100).digest() == run("sampled", 100).digest()
    assert run("cluster_mass", 2).digest() != run("sampled", 2).digest()


@pytest.mark.parametrize("key,value", [("k", 0), ("per_cycle", 0), ("cluster_order", "reverse"),
                                       ("cluster_assign", "kmeans"), ("normalize", "none")])
def test_fedcluster_bad_values_are_one_line_errors(key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "fedcluster", key: value}))
    assert str(err.value).startswith(f"config error: algorithm.{key}: ") and "\n" not in str(err.value)


def test_fedcluster_given_clusters_need_ground_truth_groups():
    with pytest.raises(ConfigError, match="algorithm.cluster_assign: 'given' needs ground-truth groups"):
        validate(tiny_config(algorithm={"name": "fedcluster", "cluster_assign": "given"}, partition={"scheme": "iid"}))


def test_fedcluster_beats_fedavg_at_equal_device_work_on_heterogeneous_least_squares():
    """Spec §3.1 sanity 4: K clients a round either way; FedCluster(M=4) makes 4 updates of
    5 clients each and ends nearer x* (benchmarks/fedcluster_lsq.py prints the whole table)."""
    from flockfl.data.lsq import hetero_lsq, lsq_config, rel_error
    from flockfl.rounds import prepare_data

    data, x_star, lam = hetero_lsq(m=20, seed=0)
    train = {"lr": 0.2 / lam, "local_epochs": 5, "rounds": 40}

    def error(algo):
        return rel_error(run_rounds(prepare_data(validate(lsq_config(algo, 20, train)), data)), x_star)

    fedavg, fedcluster = error({"name": "fedavg"}), error({"name": "fedcluster", "k": 4})
    assert fedcluster < 0.5 * fedavg, (fedcluster, fedavg)
