"""FlexCFL (and FedGroup = migration off, RCC, RAC, η_g) and FeSEM: both trainers agree, resume is
bit-identical (in a shifting run too, pre-federation never redone), the EDC Gram route gives
TruncatedSVD's partition, the W1 detector matches scipy, both inter-group formulas, Eq. 8,
migration after a swap, cluster recovery, FeSEM's E/M steps, and one-line errors for every key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, label_group_npz, tiny_config

from flockfl.algorithms import Algorithm
from flockfl.clustering import (
    edc_embedding,
    eq8_assign,
    inter_group,
    kmeans_partition,
    madc_matrix,
    nearest_centers,
    shift_detected,
    w1_labels,
    w1_sorted_counts,
)
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.engine import TRAINERS
from flockfl.rounds import prepare, run_rounds

SWAP = {"kind": "swap_all", "probability": 0.5}
CASES = [
    ({"name": "flexcfl", "k": 2, "alpha": 3}, {}),
    ({"name": "flexcfl", "k": 2, "alpha": 3}, SWAP),
    ({"name": "flexcfl", "k": 2, "alpha": 3, "shift_detector": "label_aware", "tau_ratio": 0.05}, SWAP),
    ({"name": "flexcfl", "k": 2, "alpha": 3, "eta_g": 0.5, "group_init": "madc"}, {}),
    ({"name": "flexcfl", "k": 2, "alpha": 3, "eta_g": 0.2, "inter_group_mode": "paper", "pretrain_steps": None}, {}),
    ({"name": "flexcfl", "k": 2, "group_init": "rcc", "cold_assign": "random"}, SWAP),
    ({"name": "fesem", "k": 2}, {}),
    ({"name": "fesem", "k": 2, "legacy_first_update_only": True, "migration": True}, SWAP),
]
IDS = ["flexcfl", "flexcfl-swap", "flexcfl-label_aware-swap", "madc-eta", "paper-eta-epochs", "rcc-rac-swap", "fesem",
       "fesem-legacy-mig-swap"]


def cfg_of(algo: dict, shift: dict | None = None, **train):
    return validate(tiny_config(algorithm=algo, shift=shift or {}, train={"rounds": 3, "clients_per_round": 4, **train}))


@pytest.mark.parametrize("algo,shift", CASES, ids=IDS)
def test_both_trainers_agree(tmp_path, algo, shift):
    ref, vec = assert_trainers_agree(lambda e: cfg_of(algo, shift, engine=e), tmp_path)
    np.testing.assert_array_equal(vec.assignment_history, ref.assignment_history)


@pytest.mark.parametrize("algo,shift", [CASES[1], CASES[3], CASES[7]], ids=["flexcfl-swap", "madc-eta", "fesem-mig-swap"])
def test_resume_is_bit_identical_mid_shift_and_never_redoes_the_group_cold_start(tmp_path, algo, shift):
    cfg = cfg_of(algo, shift, engine="vectorized")
    def refuse(*_):
        raise AssertionError("the pre-federation step ran again on resume")

    def forbid(prep):
        prep.algorithm.pre_federation = refuse

    full, resumed = assert_resume_bit_identical(cfg, tmp_path, prepare_resumed=forbid)
    for a, b in zip(resumed.history, full.history):
        assert a == {**b, "round_time_s": a["round_time_s"]}
    if shift:
        assert sum(h["clients_shifted"] for h in full.history) > 0


# ---------------------------------------------------------------------- group cold start


def clustered_updates(n=40, d=300, m=4, seed=0, noise=0.3):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(m, d))
    truth = rng.integers(0, m, size=n)
    return centers[truth] * rng.uniform(0.5, 2.0, size=(n, 1)) + noise * rng.normal(size=(n, d)), truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edc_gram_route_equals_truncated_svd_and_gives_its_partition(seed):
    from sklearn.metrics import adjusted_rand_score

    delta, truth = clustered_updates(seed=seed)
    gram, svd = edc_embedding(delta, 4, "gram"), edc_embedding(delta, 4, "svd", seed=seed)
    assert gram.shape == (40, 4)
    # the same directions up to each column's sign: every Euclidean distance between rows is equal
    np.testing.assert_allclose(np.abs(gram), np.abs(svd), atol=1e-6)
    d = lambda e: np.linalg.norm(e[:, None] - e[None], axis=-1)  # noqa: E731
    np.testing.assert_allclose(d(gram), d(svd), atol=1e-6)
    a, b = kmeans_partition(gram, 4, 7), kmeans_partition(svd, 4, 7)
    np.testing.assert_array_equal(a, b)
    assert adjusted_rand_score(truth, a) == 1.0
    # EDC's rows are cosines with unit directions: inside the unit ball
    assert np.all(np.linalg.norm(gram, axis=1) <= 1 + 1e-9)


def test_madc_matches_its_definition_and_separates_clusters():
    from flockfl import clustering
    from sklearn.metrics import adjusted_rand_score

    delta, truth = clustered_updates(n=15, m=3, seed=4)
    d = madc_matrix(delta)
    unit = delta / np.linalg.norm(delta, axis=1, keepdims=True)
    s = unit @ unit.T
    i, j = 2, 9
    z = [t for t in range(15) if t not in (i, j)]
    assert d[i, j] == pytest.approx(np.abs(s[i, z] - s[j, z]).sum() / 13)
    assert np.allclose(d, d.T) and np.all(np.diag(d) == 0)
    labels = clustering.hierarchical_clusters(d, n_clusters=3, linkage="complete")
    assert adjusted_rand_score(truth, labels) == 1.0


def test_group_cold_start_cost_is_in_the_state(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3}), tmp_path), until=1)
    assert len(state.algo["pretrain_clients"]) == 6 and sorted(set(state.algo["pretrain_labels"].tolist())) == [0, 1]
    # §6.4: α·m updates up; w_0 to the α·m pre-training clients and the m directions to all 12 clients down
    per_model = sum(v[0].numel() for v in state.models.values()) * 4
    cost = state.driver.pre_federation
    assert cost["bytes_up"] == 6 * per_model and cost["bytes_down"] == 6 * per_model + 12 * 2 * per_model
    # per round: one model down and one up per selected client, as FedAvg
    assert state.history[0]["bytes_down"] == state.history[0]["bytes_up"] == 4 * per_model


def test_group_models_start_at_their_clusters_mean_pretrained_model(tmp_path):
    prep = prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3}), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.pre_federation(alg.init_state(ctx), ctx)
    chosen, labels = state.algo["pretrain_clients"].numpy(), state.algo["pretrain_labels"].numpy()
    params, delta = alg.pretrain(state, ctx, chosen, -1, "flexcfl/pretrain")  # the same streams: the same models
    for j in range(2):
        members = torch.from_numpy(np.flatnonzero(labels == j))
        for k in params:
            assert torch.allclose(state.models[k][j], params[k][members].double().mean(0).float(), atol=1e-6)
        np.testing.assert_allclose(state.algo["directions"][j].numpy(), delta[labels == j].mean(0), atol=1e-9)
    np.testing.assert_array_equal(state.assignments[chosen], labels)
    assert (np.delete(state.assignments, chosen) == -1).all()


# ---------------------------------------------------------------------- client cold start, detector


def test_eq8_assigns_the_least_cosine_dissimilar_initial_direction():
    dirs = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 0]])  # the third group has no direction (cos = 0)
    delta = np.array([[2.0, 0.1, 0], [-1.0, 0.2, 0], [-1.0, -3.0, 0], [0, 0, 0]])
    groups, dis = eq8_assign(delta, dirs)
    # the third update points away from both directions: the empty direction (dissimilarity ½) is nearest
    np.testing.assert_array_equal(groups, [0, 1, 2, 0])
    assert dis.min() >= 0 and dis.max() <= 1
    assert dis[0, 0] == pytest.approx((1 - 2 / np.hypot(2, 0.1)) / 2)
    np.testing.assert_allclose(dis[3], 0.5)  # a zero update is equally far from everything: the lowest index wins


def test_w1_detector_matches_scipy():
    from scipy.stats import wasserstein_distance

    rng = np.random.default_rng(0)
    curr, prev = rng.integers(0, 50, size=(20, 10)), rng.integers(0, 50, size=(20, 10))
    prev[3] = 0
    for c, p, a, b in zip(curr, prev, w1_sorted_counts(curr, prev), w1_labels(curr, prev)):
        assert a == pytest.approx(wasserstein_distance(c, p))
        if p.sum():
            assert b == pytest.approx(wasserstein_distance(np.arange(10), np.arange(10), c, p))
    # the code's statistic cannot see a relabelling; the label-aware one can
    c = np.array([[30, 10, 0, 0]])
    p = np.array([[0, 0, 10, 30]])
    assert w1_sorted_counts(c, p)[0] == 0 and not shift_detected(c, p, [40], 0.2, "code")[0]
    assert shift_detected(c, p, [40], 0.2, "label_aware")[0]
    # τ_i = 0.2·n_i/C: Σ|sort diff| must exceed 20% of the construction-time size
    p2 = np.array([[30, 10, 0, 0]])
    assert not shift_detected(np.array([[26, 10, 4, 0]]), p2, [40], 0.2, "code")[0]  # 8/4 = 2 = τ
    assert shift_detected(np.array([[25, 10, 5, 0]]), p2, [40], 0.2, "code")[0]  # 10/4 > 2


# ---------------------------------------------------------------------- inter-group aggregation


def test_inter_group_formulas():
    rng = np.random.default_rng(1)
    models = rng.normal(size=(3, 8))
    for mode in ("normalized_avg", "paper"):
        np.testing.assert_array_equal(inter_group(models, 0.0, mode), models)
    # code formula: a convex combination with weights ∝ (1, η/‖w_l‖ for l ≠ j); read off on a scaled basis
    basis = np.diag([1.0, 2.0, 4.0])
    eta = 5.0
    out = inter_group(basis, eta, "normalized_avg")
    coef = out / np.diag(basis)[None, :]
    np.testing.assert_allclose(coef.sum(1), 1.0)
    assert (coef > 0).all()
    np.testing.assert_allclose(coef[0], np.array([1, eta / 2, eta / 4]) / (1 + eta / 2 + eta / 4))
    # paper formula: adds η times the other groups' unit vectors
    paper = inter_group(basis, eta, "paper")
    np.testing.assert_allclose(paper[0], [1, eta, eta])
    # one group: nothing to mix
    np.testing.assert_array_equal(inter_group(models[:1], eta, "paper"), models[:1])


def test_eta_g_mixes_the_group_models_and_zero_keeps_them_independent(tmp_path):
    base = run_rounds(prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3}), tmp_path))
    zero_paper = run_rounds(prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3, "inter_group_mode": "paper"}), tmp_path))
    assert base.digest() == zero_paper.digest()
    mixed = run_rounds(prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3, "eta_g": 5.0}), tmp_path))

    def gap(s):
        return float(sum((s.models[k][0] - s.models[k][1]).norm() ** 2 for k in s.models) ** 0.5)

    assert gap(mixed) < gap(base)
    assert all(h["bytes_inter_group"] > 0 for h in mixed.history) and all(h["bytes_inter_group"] == 0 for h in base.history)


# ---------------------------------------------------------------------- rounds: selection, migration, recovery


def test_round_robin_then_random_selection_and_lazy_cold_start(tmp_path):
    prep = prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3}, rounds=5, clients_per_round=5), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = run_rounds(prep)
    picked = [alg.select(state, ctx, r).tolist() for r in range(4)]
    # ⌈12/5⌉ = 3 rounds in id order, wrapping, then uniform draws
    assert picked[:3] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 10, 11]]
    assert picked[3] == Algorithm.select(alg, state, ctx, 3).tolist()
    assert (state.assignments >= 0).all()
    # every client is warm from round ⌈N/K⌉ = 3 on; cold ones joined only when selected
    cov = [h["coverage"] for h in state.history]
    assert cov[2:] == [1.0, 1.0, 1.0] and cov[0] < 1.0
    cold = 12 - len(state.algo["pretrain_clients"])
    assert sum(h["clients_cold_started"] for h in state.history) == cold
    row = state.history[-1]
    assert {"accuracy_global", "loss_global", "discrepancy", "clients_migrated", "cluster/0/clients"} <= set(row)
    off = prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3, "round_robin": False}, clients_per_round=5), tmp_path)
    assert off.algorithm.select(state, off.ctx, 0).tolist() == Algorithm.select(alg, state, ctx, 0).tolist()


def label_groups_npz(path, groups=((0, 1), (2, 3, 4), (5, 6, 7)), per_group=6, n=30, seed=0):
    """Clients of three groups with disjoint label sets (FEMNIST/MNIST-like label skew), each
    label a Gaussian around its own prototype."""
    def features(rng):
        protos = rng.normal(size=(8, 16)) * 2
        return lambda y: (protos[y] + rng.normal(size=(len(y), 16))).astype(np.float32).reshape(len(y), 1, 4, 4)

    return label_group_npz(path, groups, per_group, n, seed, features)


def npz_cfg(tmp_path, algo, shift=None, rounds=5):
    label_groups_npz(tmp_path / "groups.npz")
    return validate({"seed": 1, "dataset": {"name": "npz", "path": str(tmp_path / "groups.npz")},
                     "partition": {"scheme": "natural"}, "model": {"name": "mclr"}, "algorithm": algo,
                     "shift": shift or {}, "tracking": {"enabled": False},
                     "train": {"rounds": rounds, "clients_per_round": 6, "local_epochs": 1, "batch_size": 10, "lr": 0.1,
                               "engine": "vectorized"}})


def test_migration_fires_after_a_swap_and_not_without_one_and_fedgroup_never_migrates(tmp_path):
    algo = {"name": "flexcfl", "k": 3, "alpha": 2}
    flex = run_rounds(prepare(npz_cfg(tmp_path, algo, SWAP), tmp_path))
    shifted = sum(h["clients_shifted"] for h in flex.history)
    detected = sum(h["clients_shift_detected"] for h in flex.history)
    assert shifted > 0 and 0 < detected <= shifted
    assert sum(h["clients_migrated"] for h in flex.history) > 0
    still = run_rounds(prepare(npz_cfg(tmp_path, algo), tmp_path))
    assert sum(h["clients_shift_detected"] + h["clients_migrated"] for h in still.history) == 0
    fedgroup = run_rounds(prepare(npz_cfg(tmp_path, {**algo, "migration": False}, SWAP), tmp_path))
    assert [h["clients_shifted"] for h in fedgroup.history] == [h["clients_shifted"] for h in flex.history]
    assert sum(h["clients_shift_detected"] + h["clients_migrated"] for h in fedgroup.history) == 0
    hist = fedgroup.assignment_history
    for c in range(hist.shape[1]):  # once in a group, a FedGroup client stays there
        warm = hist[:, c][hist[:, c] >= 0]
        assert len(set(warm.tolist())) <= 1


def test_label_aware_migration_follows_the_data_where_the_static_groups_do_not(tmp_path):
    """Groups 1 and 2 both hold 3 labels, so their sorted count vectors look alike and the code's
    detector misses swaps between them (spec §8 item 4); the label-aware one sees every swap
    across groups, and each mover's Eq. 8 cold start on its new data puts it in that data's group."""
    from sklearn.metrics import adjusted_rand_score

    from flockfl.stages import shift as shift_mod

    aware = {"name": "flexcfl", "k": 3, "alpha": 2, "shift_detector": "label_aware"}
    flex = run_rounds(prepare(npz_cfg(tmp_path, aware, SWAP), tmp_path))
    fedgroup = run_rounds(prepare(npz_cfg(tmp_path, {**aware, "migration": False}, SWAP), tmp_path))
    prep = prepare(npz_cfg(tmp_path, aware, SWAP), tmp_path)
    shift_mod.sync(prep.ctx, flex)  # the data as the run left it: ground-truth groups follow the samples
    assert adjusted_rand_score(prep.ctx.data.group, flex.assignments) == 1.0
    shift_mod.sync(prep.ctx, fedgroup)
    assert adjusted_rand_score(prep.ctx.data.group, fedgroup.assignments) < 0.9


def test_flexcfl_recovers_rotated_digit_clusters(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "flexcfl", "k": 2, "alpha": 3}, rounds=3), tmp_path))
    assert state.history[-1]["ari"] == 1.0 and state.history[-1]["coverage"] == 1.0


def test_disjoint_label_groups_are_recovered_by_every_group_init(tmp_path):
    from sklearn.metrics import adjusted_rand_score

    for init in ("edc", "madc"):
        state = run_rounds(prepare(npz_cfg(tmp_path, {"name": "flexcfl", "k": 3, "alpha": 2, "group_init": init},
                                           rounds=3), tmp_path))
        truth = np.repeat([0, 1, 2], 6)
        assert adjusted_rand_score(truth, state.assignments) == 1.0, init


def test_newcomers_are_cold_started(tmp_path):
    cfg = validate(tiny_config(algorithm={"name": "flexcfl", "k": 2, "alpha": 2}, partition={"unseen_fraction": 0.25},
                               train={"rounds": 2, "clients_per_round": 4, "finetune_epochs": 1}))
    state = run_rounds(prepare(cfg, tmp_path))
    info = state.driver.newcomers
    assert len(info["clusters"]) == 3 and info["rule"] == "Eq. 8 cold start"
    assert 0.0 <= state.history[-1]["unseen_accuracy"] <= 1.0


# ---------------------------------------------------------------------- FeSEM


def one_round(tmp_path, algo):
    prep = prepare(cfg_of(algo, engine="vectorized"), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.init_state(ctx)
    clients = alg.select(state, ctx, 0)
    state = alg.before_training(state, ctx, clients, 0)
    spec = alg.local_spec(state, ctx, clients, 0)
    result = TRAINERS["vectorized"](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, 0)
    assign = alg.cluster(state, ctx, spec, result)
    return alg, ctx, state, result, assign, alg.aggregate(state, ctx, spec, result, assign)


def test_fesem_e_and_m_steps(tmp_path):
    alg, ctx, state, result, assign, new = one_round(tmp_path, {"name": "fesem", "k": 3})
    # never-trained clients hold w_0: all go to the center nearest w_0
    flat = lambda p: torch.cat([v.reshape(v.shape[0], -1) for v in p.values()], 1).double().numpy()  # noqa: E731
    w0 = flat({k: v.unsqueeze(0) for k, v in state.algo["w0"].items()})
    j = int(nearest_centers(w0, flat(state.models))[0])
    assert (assign == j).all() and (state.assignments[result.clients] == j).all()
    # M-step: the simple average of the members' models; the other centers unchanged
    for k in new.models:
        assert torch.allclose(new.models[k][j], result.params[k].mean(0), atol=1e-6)
        for other in set(range(3)) - {j}:
            assert torch.equal(new.models[k][other], state.models[k][other])
        assert torch.equal(new.algo["last_local"].gather(result.clients)[k], result.params[k])
    # the legacy bug: only the first selected member's model
    _, _, _, result2, assign2, legacy = one_round(tmp_path, {"name": "fesem", "k": 3, "legacy_first_update_only": True})
    for k in legacy.models:
        assert torch.equal(legacy.models[k][j], result2.params[k][0])


def test_fesem_reassigns_selected_clients_to_the_nearest_center_every_round(tmp_path):
    prep = prepare(cfg_of({"name": "fesem", "k": 2}, rounds=3), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = run_rounds(prep)
    assert state.history[-1]["coverage"] == 1.0 and "clients_reassigned" in state.history[-1]
    clients = alg.select(state, ctx, 3)
    after = alg.before_training(state, ctx, clients, 3)
    np.testing.assert_array_equal(after.assignments[clients], alg.nearest(state, clients))
    others = np.setdiff1d(np.arange(12), clients)
    np.testing.assert_array_equal(after.assignments[others], state.assignments[others])
    # a newcomer never trained: the center nearest w_0
    _, assign, rule = alg.admit_newcomers(state, ctx, np.array([0, 1]))
    assert len(set(assign.tolist())) == 1 and "w_0" in rule


# ---------------------------------------------------------------------- config


BAD = [
    ("flexcfl", "k", 0), ("flexcfl", "alpha", 0), ("flexcfl", "alpha", 1.5), ("flexcfl", "pretrain_steps", 0),
    ("flexcfl", "group_init", "spectral"), ("flexcfl", "cold_assign", "nearest"), ("flexcfl", "migration", "yes"),
    ("flexcfl", "shift_detector", "emd"), ("flexcfl", "tau_ratio", 0), ("flexcfl", "eta_g", -1.0),
    ("flexcfl", "inter_group_mode", "sum"), ("flexcfl", "kmeans_max_iter", 0), ("flexcfl", "round_robin", 1),
    ("fesem", "k", 0), ("fesem", "legacy_first_update_only", "no"), ("fesem", "migration", 1),
    ("fesem", "shift_detector", "l1"), ("fesem", "tau_ratio", -0.1), ("fesem", "round_robin", "x"),
]


@pytest.mark.parametrize("algorithm,key,value", BAD, ids=[f"{a}.{k}={v}" for a, k, v in BAD])
def test_bad_values_are_one_line_errors(algorithm, key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": algorithm, key: value}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}:") and "\n" not in msg


def test_more_groups_than_clients_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "flexcfl", "k": 13}))
    assert str(err.value).startswith("config error: algorithm.k:") and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["flexcfl", "fesem"])
def test_still_cold_clients_are_left_out_of_accuracy_and_fine_tune_from_the_fallback_model(tmp_path, name):
    algo = {"name": name, "k": 2, "round_robin": False, **({"group_init": "rcc"} if name == "flexcfl" else {})}
    state = run_rounds(prepare(cfg_of(algo, rounds=1), tmp_path))
    row = state.history[-1]
    cold = int((state.assignments < 0).sum())
    assert cold > 0 and row["coverage"] == pytest.approx(1 - cold / 12) and row["clients_warm"] == 12 - cold
    assert 0.0 <= row["accuracy_finetuned"] <= 1.0
    assert (state.assignment_history[-1] == state.assignments).all()
