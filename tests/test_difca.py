"""DIFCA (decentralised IFCA, seed 002, spec §2.3): both trainers agree, resume is bit-identical,
the gossip sanity tests (R large → the cluster mean = IFCA option II's aggregate; one token per
non-empty cluster; R = 0 → the token holder's own model), the reference code's exchange by
hand, label-free confidence inference, the peer-to-peer bytes, and one-line config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, rel_err, tiny_config

from flockfl.algorithms.difca import DIFCA, gossip
from flockfl.algorithms.model_choice import confidence_scores
from flockfl.clustering.gossip import pick_tokens, reference_gossip, reference_threshold
from flockfl.algorithms.ifca import IFCA
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.engine import TRAINERS
from flockfl.engine.trainers import TrainResult
from flockfl.rounds import prepare, run_rounds
from flockfl.state import ServerState

VARIANTS = [
    {"name": "difca"},
    {"name": "difca", "gossip": "matching", "gossip_weighting": "samples", "init": "random"},
    {"name": "difca", "partners": 0, "inference": "confidence", "participation": "sampled"},
    {"name": "difca", "dfca_variant": "reference_gi"},
    {"name": "difca", "dfca_variant": "reference_li", "inference": "confidence"},
    # "DIFCA + k-means start": IFCA's library pre-federation step, then every client's copies start from it
    {"name": "difca", "dfca_variant": "reference_gi", "init": "pretrain_kmeans"},
]
IDS = [",".join(f"{k}={v}" for k, v in a.items() if k != "name") or "default" for a in VARIANTS]


def cfg_of(algo: dict, **train):
    return validate(tiny_config(algorithm=algo, train={"rounds": 4, "clients_per_round": 6, **train}))


# ---------------------------------------------------------------------- the round driver


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_both_trainers_agree(tmp_path, algo):
    ref, vec = assert_trainers_agree(lambda e: cfg_of(algo, engine=e), tmp_path)
    assert rel_err(vec.models, ref.models) < 1e-5
    np.testing.assert_array_equal(vec.assignments, ref.assignments)
    assert torch.equal(vec.algo["token_holder"], ref.algo["token_holder"])
    if "client_models" in ref.algo:
        assert rel_err(vec.algo["client_models"], ref.algo["client_models"]) < 1e-5


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_resume_is_bit_identical(tmp_path, algo):
    cfg = cfg_of(algo, engine="vectorized")
    assert_resume_bit_identical(cfg, tmp_path)


def test_peer_to_peer_bytes_are_logged_apart_from_the_server_bytes(tmp_path):
    cfg = cfg_of({"name": "difca", "init": "random"})
    assert cfg.algorithm.partners == 10 and cfg.algorithm.gossip == "random_pairs"
    state = run_rounds(prepare(cfg, tmp_path))
    per_model = DIFCA(cfg).model_bytes(state)
    for i, row in enumerate(state.history):
        assert row["bytes_p2p"] > 0 and row["gossip_exchanges"] > 0
        # the server publishes the k initial models once and then only listens (one model per token)
        assert row["bytes_down"] == (6 * 2 * per_model if i == 0 else 0)
        assert row["bytes_up"] % per_model == 0 and 1 <= row["bytes_up"] // per_model <= 2
    # random_pairs: every one of the m members of a cluster starts an exchange in each of R repeats
    assert state.history[-1]["gossip_exchanges"] == 10 * 6


def test_the_participant_set_is_fixed_for_the_run(tmp_path):
    prep = prepare(cfg_of({"name": "difca"}), tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    chosen = {tuple(prep.algorithm.select(state, prep.ctx, r)) for r in range(5)}
    assert len(chosen) == 1 and len(next(iter(chosen))) == 6
    assert tuple(state.algo["participants"].tolist()) in chosen
    sampled = prepare(cfg_of({"name": "difca", "participation": "sampled"}), tmp_path)
    st = sampled.algorithm.init_state(sampled.ctx)
    assert len({tuple(sampled.algorithm.select(st, sampled.ctx, r)) for r in range(5)}) > 1


# ---------------------------------------------------------------------- gossip sanity tests


def local_models(m: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(m, 5, 3, generator=g), "b": torch.randn(m, 3, generator=g) + 2.0}


def ifca_aggregate(params: dict[str, torch.Tensor], sizes: np.ndarray, weighting: str) -> dict[str, torch.Tensor]:
    """IFCA option II's aggregate of one cluster (all rows in cluster 0), through IFCA.aggregate."""
    m = len(sizes)
    cfg = validate(tiny_config(algorithm={"name": "ifca", "k": 1, "weighting": weighting, "init": "random"}))
    state = ServerState(0, {k: torch.zeros(1, *v.shape[1:]) for k, v in params.items()}, np.full(m, -1),
                        np.zeros((0, m), np.int64))
    result = TrainResult(np.arange(m), params, sizes, np.ones(m, np.int64), np.zeros(m))
    return {k: v[0] for k, v in IFCA(cfg).aggregate(state, None, None, result, np.zeros(m, np.int64)).models.items()}


@pytest.mark.parametrize("mode", ["matching", "random_pairs"])
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_many_exchanges_reach_the_cluster_mean_which_is_ifcas_aggregate(mode, weighting):
    params, sizes = local_models(7), np.array([3, 10, 1, 7, 7, 2, 30])
    mixed, exchanges = gossip(params, sizes, 50, mode, weighting, np.random.default_rng(1))
    assert exchanges == 50 * (3 if mode == "matching" else 7)
    target = ifca_aggregate(params, sizes, weighting)
    for k in params:
        err = (mixed[k] - target[k].unsqueeze(0)).flatten(1).norm(dim=1) / target[k].norm()
        assert float(err.max()) < 1e-6, (k, float(err.max()))


@pytest.mark.parametrize("mode", ["matching", "random_pairs"])
def test_every_exchange_conserves_the_cluster_mean(mode):
    params = local_models(6, seed=3)
    for repeats in (1, 2, 5):
        mixed, _ = gossip(params, np.ones(6), repeats, mode, "uniform", np.random.default_rng(repeats))
        for k in params:
            assert torch.allclose(mixed[k].mean(0), params[k].mean(0), rtol=1e-6, atol=1e-6)
        # both partners of an exchange hold the same value: fewer distinct rows than before
        assert len(torch.unique(mixed["b"], dim=0)) < 6


def test_no_exchanges_and_single_members_leave_the_models_alone():
    params = local_models(4)
    rng = np.random.default_rng(0)
    for out, ex in (gossip(params, np.ones(4), 0, "random_pairs", "uniform", rng),
                    gossip({k: v[:1] for k, v in params.items()}, np.ones(1), 10, "matching", "uniform", rng)):
        assert ex == 0
        assert all(torch.equal(out[k], params[k][: len(out[k])]) for k in params)


def one_round(tmp_path, algo):
    """Round 0 by hand, through the hooks: (state before, spec, trained result, assignments, state after)."""
    prep = prepare(cfg_of({"init": "random", **algo}, engine="reference"), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.init_state(ctx)
    spec = alg.local_spec(state, ctx, alg.select(state, ctx, 0), 0)
    result = TRAINERS["reference"](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, 0)
    assign = alg.cluster(state, ctx, spec, result)
    return state, spec, result, assign, alg.aggregate(state, ctx, spec, result, assign)


def test_with_no_partners_the_representative_is_the_token_holders_own_model(tmp_path):
    state, spec, result, assign, new = one_round(tmp_path, {"name": "difca", "k": 3, "partners": 0})
    holder = new.algo["token_holder"].numpy()
    pos = {int(c): i for i, c in enumerate(result.clients)}
    for c in range(3):
        if (assign == c).any():
            assert assign[pos[int(holder[c])]] == c
            assert all(torch.equal(new.models[k][c], result.params[k][pos[int(holder[c])]]) for k in new.models)
        else:  # a cluster nobody chose keeps its model and gets no token
            assert holder[c] == -1
            assert all(torch.equal(new.models[k][c], state.models[k][c]) for k in new.models)


def test_exactly_one_token_per_non_empty_cluster_every_round(tmp_path):
    prep = prepare(cfg_of({"name": "difca", "k": 3}, rounds=5), tmp_path)
    seen = []
    run_rounds(prep, on_round=lambda s, row: seen.append((s.algo["token_holder"].numpy().copy(), s.assignments.copy())))
    participants = prep.algorithm.select(prep.algorithm.init_state(prep.ctx), prep.ctx, 0)
    for holder, assignments in seen:
        chosen = assignments[participants]
        assert sorted(np.flatnonzero(holder >= 0)) == sorted(np.unique(chosen))
        for c in np.flatnonzero(holder >= 0):
            assert holder[c] in participants and assignments[holder[c]] == c
    # the draw: uniform among the members, one per cluster, from the (seed, round, cluster) stream
    assign = np.array([0, 2, 0, 2, 2, 0])
    tokens = pick_tokens(assign, 4, seed=3, round=7)
    assert tokens[1] == -1 and tokens[3] == -1 and assign[tokens[0]] == 0 and assign[tokens[2]] == 2
    assert np.array_equal(tokens, pick_tokens(assign, 4, seed=3, round=7))


def test_many_matching_rounds_reproduce_ifca_option_ii(tmp_path):
    """R → ∞ makes DIFCA IFCA option II: the same cohort (every client), init, training and
    assignments; the representatives equal IFCA's per-cluster means."""
    common = {"k": 2, "init": "random"}
    ifca = run_rounds(prepare(cfg_of({"name": "ifca", **common}, rounds=3, clients_per_round=12), tmp_path))
    difca = run_rounds(prepare(cfg_of({"name": "difca", "partners": 60, "gossip": "matching", **common},
                                      rounds=3, clients_per_round=12), tmp_path))
    np.testing.assert_array_equal(difca.assignments, ifca.assignments)
    assert rel_err(difca.models, ifca.models) < 1e-5


# ---------------------------------------------------------------------- the reference code's variant


class ScriptedRng:
    """Stands in for the partner stream: the partner lists and entry removals are given."""

    def __init__(self, lists):
        self.lists = list(lists)

    def integers(self, low, high=None, size=None):
        return np.ones(size, np.int64) if size is not None else 0

    def choice(self, a, size, replace):
        return np.array(self.lists.pop(0))


def test_reference_exchange_by_hand():
    # three participants, k = 2, one number per model; clusters 0, 0, 1; partners 0→1, 1→0, 2→0
    f = torch.tensor([[[1.0], [10.0]], [[3.0], [30.0]], [[5.0], [50.0]]])
    exchanges = reference_gossip(f, np.array([0, 0, 1]), ScriptedRng([[1], [0], [0]]))
    # 0↔1 (same cluster, α = 0.5): θ_{0,0} ← (1 + 3)/2 = 2, then θ_{1,0} ← (3 + 2)/2 = 2.5; 1's list drops 0
    # 2↔0 (α = 0.4): θ_{2,0} ← 0.4·5 + 0.6·2 = 3.2, θ_{0,1} ← 0.4·10 + 0.6·50 = 34; 0's list loses an entry
    expected = torch.tensor([[[2.0], [34.0]], [[2.5], [30.0]], [[3.2], [50.0]]])
    assert exchanges == 2
    assert torch.allclose(f, expected)


def test_reference_partner_counts():
    assert [reference_threshold(m) for m in (2, 3, 10, 48, 801)] == [1, 2, 9, 15, 50]
    f = torch.zeros(2, 2, 1)
    assert reference_gossip(f, np.array([0, 1]), np.random.default_rng(0)) == 0  # h ≤ 1: no gossip


def test_reference_variants_keep_every_clients_k_models(tmp_path):
    prep = prepare(cfg_of({"name": "difca", "k": 3, "dfca_variant": "reference_gi", "init": "random"}), tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    cm = state.algo["client_models"]
    assert all(v.shape == (12, *state.models[k].shape) for k, v in cm.items())
    assert all(torch.equal(cm[k][i], state.models[k]) for k in cm for i in range(12))  # GI: the same k models
    li = prepare(cfg_of({"name": "difca", "k": 3, "dfca_variant": "reference_li", "init": "random"}), tmp_path)
    cm = li.algorithm.init_state(li.ctx).algo["client_models"]
    assert not torch.equal(cm["1.weight"][0], cm["1.weight"][1])  # LI: every client draws its own
    seed_state = prepare(cfg_of({"name": "difca"}), tmp_path)
    assert "client_models" not in seed_state.algorithm.init_state(seed_state.ctx).algo


# ---------------------------------------------------------------------- inference


def test_confidence_inference_reads_no_labels(tmp_path):
    prep = prepare(cfg_of({"name": "difca", "inference": "confidence"}), tmp_path)
    state = run_rounds(prep, until=2)
    before = prep.algorithm.eval_assignment(state, prep.ctx)
    test = prep.ctx.data.test
    saved = test.y.clone()
    test.y[:] = torch.randint(0, 10, test.y.shape, generator=torch.Generator().manual_seed(0))
    try:
        np.testing.assert_array_equal(prep.algorithm.eval_assignment(state, prep.ctx), before)
    finally:
        test.y[:] = saved


def test_confidence_is_the_mean_max_softmax(tmp_path):
    prep = prepare(cfg_of({"name": "difca", "k": 2}), tmp_path)
    ctx = prep.ctx
    state = prep.algorithm.init_state(ctx)
    flat = {k: torch.zeros_like(v) for k, v in state.models.items()}  # model 0: uniform outputs
    last_bias = [k for k in flat if k.endswith("bias")][-1]
    flat[last_bias][1, 3] = 50.0  # model 1: always class 3, confidently
    conf = confidence_scores(ctx.model, flat, ctx.data, np.arange(4))
    assert torch.allclose(conf[0], torch.full((4,), 0.1)) and bool((conf[1] > 0.99).all())


# ---------------------------------------------------------------------- configuration

BAD = [("partners", -1), ("partners", 1.5), ("gossip", "ring"), ("gossip_weighting", "median"),
       ("dfca_variant", "dfca"), ("inference", "entropy"), ("participation", "all"), ("option", "gradient"),
       ("weighting", "samples"), ("shared", "all_but_last")]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_bad_values_are_one_line_errors(key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "difca", key: value}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}: ") and "\n" not in msg


@pytest.mark.parametrize("over,key", [
    ({"algorithm": {"name": "difca", "dfca_variant": "reference_gi", "gossip": "matching"}}, "dfca_variant"),
    ({"algorithm": {"name": "difca", "dfca_variant": "reference_li", "gossip_weighting": "samples"}}, "dfca_variant"),
    ({"algorithm": {"name": "difca", "inference": "confidence"}, "dataset": {"name": "synthetic_linreg"},
      "model": {"name": "linear"}, "partition": {"scheme": "natural", "num_clients": None}}, "inference"),
], ids=["reference+matching", "reference+samples", "confidence+regression"])
def test_settings_that_do_not_go_together_are_one_line_errors(over, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}: ") and "\n" not in msg
