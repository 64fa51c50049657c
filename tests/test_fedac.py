"""FedAC (spec core-and-clustered-algorithms.md §3.3): both trainers agree, resume is bit-identical,
the spec's sanity tests 1–5 (on the pure functions where possible), the model split, the
per-client store, and a one-line error for every bad value of its keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, rel_err, tiny_config
from sklearn.metrics import adjusted_rand_score

from flockfl.algorithms.layout import split_layout
from flockfl.clustering.lrcos import (e_step, gc_ratios, lrcos, m_step, pca_map, project, tune_clusters,
                                     two_means_cosine)
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds
from models import build_model

VARIANTS = [
    {"name": "fedac", "k": 2},  # the defaults: CNT from round 0 with a = 0.1, b = 1
    {"name": "fedac", "k": 3, "center_before_project": True, "e_step": "participants", "lrcos_on": "decision",
     "pca_refresh_every": 2, "components": 3, "weighting": "uniform", "cnt_warmup": 1, "split_threshold": 0.3},
]
IDS = ["defaults", "options"]


def cfg_of(algo: dict, **train):
    return validate(tiny_config(algorithm=algo, train={"rounds": 4, "clients_per_round": 6, "threads": 1, **train}))


# ---------------------------------------------------------------------- the driver


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_both_trainers_agree(tmp_path, algo):
    ref, vec = assert_trainers_agree(lambda e: cfg_of(algo, engine=e), tmp_path)
    np.testing.assert_array_equal(vec.assignments, ref.assignments)
    assert rel_err(vec.models, ref.models) < 1e-5
    assert rel_err(vec.algo["omega"].dense(), ref.algo["omega"].dense()) < 1e-5
    np.testing.assert_array_equal(vec.algo["omega"].written(), ref.algo["omega"].written())


@pytest.mark.parametrize("algo", VARIANTS, ids=IDS)
def test_resume_is_bit_identical(tmp_path, algo):
    cfg = cfg_of(algo, engine="vectorized")
    assert_resume_bit_identical(cfg, tmp_path)


def test_the_store_holds_only_clients_that_trained_and_the_metrics_follow_r(tmp_path):
    prep = prepare(cfg_of({"name": "fedac", "k": 2}, rounds=1), tmp_path)
    state = run_rounds(prep)
    trained = np.flatnonzero(state.algo["omega"].written())
    table = state.algo["omega"]
    assert len(trained) == 6 and len(table.dirty) == 6 and table.shapes["omega"] == (64 * 16 + 16 + 16 * 10 + 10,)
    assert (state.assignments[trained] >= 0).all() and (np.delete(state.assignments, trained) == -1).all()
    row = state.history[-1]
    assert row["num_clusters"] == state.k == row["k_clusters"] == len(np.unique(state.assignments[trained]))
    seen = prep.ctx.seen
    assert row["ari"] == pytest.approx(adjusted_rand_score(prep.ctx.data.group[seen], state.assignments[seen]))
    # an untrained client is still ω^0: its own model is the common init
    untrained = np.setdiff1d(np.arange(12), trained)[0]
    assert torch.equal(prep.algorithm.omegas(state, np.array([untrained]))[0], state.algo["omega0"])


# ---------------------------------------------------------------------- sanity 1: LrCos


def test_lrcos_is_one_on_itself_and_scale_invariant_uncentred():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(8, 50, generator=g)
    m, mean = pca_map(h, 5)
    assert m.shape == (5, 50)
    torch.testing.assert_close(m @ m.T, torch.eye(5), atol=1e-5, rtol=0)
    w, omega = torch.randn(1, 50, generator=g), torch.randn(1, 50, generator=g)
    pw, po = project(w, m), project(omega, m)
    assert float(lrcos(pw, pw)) == pytest.approx(1.0, abs=1e-6)
    for c in (0.01, 3.0, 1e4):
        assert float(lrcos(pw, project(c * omega, m))) == pytest.approx(float(lrcos(pw, po)), abs=1e-5)
    # D ≤ |S_t| − 1: the centred matrix of n rows has rank n − 1
    assert pca_map(h[:4], 10)[0].shape == (3, 50) and pca_map(h, None)[0].shape == (7, 50)
    # the top components are those of the SVD of the centred matrix
    _, _, vh = torch.linalg.svd((h - h.mean(0)).double(), full_matrices=False)
    torch.testing.assert_close((m.double() @ vh[:5].T).abs(), torch.eye(5, dtype=torch.float64), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- sanity 2: E/M recovery


def three_groups(n: int = 30, dim: int = 40, noise: float = 0.05, seed: int = 0):
    rng = np.random.default_rng(seed)
    truth = np.repeat(np.arange(3), n // 3)
    base = np.eye(dim)[:3] * 3.0
    x = base[truth] + noise * rng.normal(size=(n, dim))
    return torch.tensor(x, dtype=torch.float32), truth


def test_argmax_e_step_and_m_step_recover_the_groups():
    x, truth = three_groups()
    m, _ = pca_map(x, 10)
    proj = project(x, m)
    rng = np.random.default_rng(1)
    # initial centroids: each true direction mixed with the others and noise, in a shuffled order
    cent = torch.tensor(np.eye(40)[[2, 0, 1]] * 3.0 * 0.6 + 0.4 * rng.normal(size=(3, 40)), dtype=torch.float32)
    labels = e_step(lrcos(proj, project(cent, m)))
    for _ in range(2):
        cent, labels = m_step(x, labels)
        labels = e_step(lrcos(proj, project(cent, m)))
    assert adjusted_rand_score(truth, labels) == 1.0
    # the seed's argmin would split every group over the two centroids it is least like
    anti = e_step(-lrcos(proj, project(m_step(x, labels)[0], m)))
    assert adjusted_rand_score(truth, anti) < 0.5
    assert e_step(torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2]])).tolist() == [1, 0]  # argmax, ties → lowest


def test_m_step_drops_empty_clusters_and_keeps_the_order():
    x = torch.arange(12.0).reshape(6, 2)
    cent, labels = m_step(x, np.array([3, 3, 0, 0, 5, 5]))
    assert labels.tolist() == [1, 1, 0, 0, 2, 2]
    torch.testing.assert_close(cent, torch.stack([x[2:4].mean(0), x[0:2].mean(0), x[4:6].mean(0)]))


# ---------------------------------------------------------------------- sanity 3–4: CNT


def test_cnt_merges_three_singletons_of_one_group_into_it():
    """K = 5: two whole groups of 10, and the 3 clients of a third group as singletons. Merges
    never chain within a pass (the first pass pairs two singletons); after the passes K = 3, pure."""
    rng = np.random.default_rng(0)
    truth = np.repeat([0, 1, 2], [10, 10, 3])
    x = torch.tensor(np.eye(20)[truth] * 3.0 + 0.3 * rng.normal(size=(23, 20)), dtype=torch.float32)
    labels = np.array([0] * 10 + [1] * 10 + [2, 3, 4])
    first = tune_clusters(x, x, labels, a=0.05, b=10.0)
    assert first.g[2:].tolist() == [0.0, 0.0, 0.0] and (first.g[:2] > 0.05).all()
    assert first.merged == 1 and len(first.centroids) == 4  # two singletons paired; the third waits
    tuned, passes = first, 1
    while tuned.merged or tuned.split:
        tuned, passes = tune_clusters(x, x, tuned.labels, a=0.05, b=10.0), passes + 1
    assert len(tuned.centroids) == 3 and adjusted_rand_score(truth, tuned.labels) == 1.0 and passes <= 4


def test_cnt_splits_one_cluster_holding_two_groups():
    rng = np.random.default_rng(0)
    truth = np.repeat([0, 1], 10)
    x = torch.tensor(np.eye(20)[truth] * 3.0 + 0.2 * rng.normal(size=(20, 20)), dtype=torch.float32)
    labels = np.zeros(20, np.int64)
    g = gc_ratios(x, labels, x.mean(0, keepdim=True))  # K = 1: Dist_inter = ‖Ω‖²
    m, _ = pca_map(x, 5)
    # with K = 1 there is nothing to merge with, whatever a is
    tuned = tune_clusters(x, project(x, m), labels, a=1e9, b=float(g[0]) * 0.9)
    assert tuned.merged == 0 and tuned.split == 1 and len(tuned.centroids) == 2
    assert adjusted_rand_score(truth, tuned.labels) == 1.0
    # b above G: nothing happens; a cluster of one never splits
    assert len(tune_clusters(x, x, labels, a=0.0, b=float(g[0]) * 1.1).centroids) == 1
    assert tune_clusters(x[:1], x[:1], labels[:1], a=0.0, b=1e-9).split == 0


def test_cnt_actions_follow_the_g_computed_before_tuning():
    """A cluster whose merge partner is also due to split is left alone (the G of the pass decide)."""
    rng = np.random.default_rng(2)
    truth = np.repeat([0, 1, 2], [10, 10, 1])
    x = torch.tensor(np.eye(20)[truth] * 3.0 + 0.3 * rng.normal(size=(21, 20)), dtype=torch.float32)
    tuned = tune_clusters(x, x, truth.copy(), a=0.05, b=10.0)
    assert tuned.merged == 1 and len(tuned.centroids) == 2  # the singleton joins its nearest cluster
    assert set(np.bincount(tuned.labels)) == {10, 11}


def test_two_means_cosine_is_deterministic_and_separates_directions():
    x, truth = three_groups(21, noise=0.05)
    two = x[truth < 2]
    a, b = two_means_cosine(two), two_means_cosine(two)
    assert np.array_equal(a, b) and adjusted_rand_score(truth[truth < 2], a) == 1.0


# ---------------------------------------------------------------------- sanity 5


def test_mu_lambda_zero_is_independent_local_training(tmp_path):
    cut = {"merge_threshold": 0.0, "split_threshold": 1e9}
    fedac = run_rounds(prepare(cfg_of({"name": "fedac", "mu": 0.0, "lam": 0.0, **cut}, engine="vectorized"), tmp_path))
    local = run_rounds(prepare(cfg_of({"name": "local"}, engine="vectorized"), tmp_path))
    prep = prepare(cfg_of({"name": "fedac"}), tmp_path)
    lay = prep.algorithm.layout(prep.ctx)
    trained = np.flatnonzero(fedac.algo["omega"].written())
    assert len(trained) > 6
    ours = prep.algorithm.omegas(fedac, trained)
    theirs = lay.flatten({k: v[torch.from_numpy(trained)] for k, v in local.models.items()})
    assert torch.equal(ours, theirs)


def test_lambda_zero_with_one_cluster_is_fedprox_to_the_centroid(tmp_path):
    """One round, everyone trains from ω^0 with the pull μ(ω − Ω) to Ω = ω^0: FedProx's clients;
    the M-step is their uniform mean, FedProx's aggregate with uniform weights."""
    over = {"rounds": 1, "clients_per_round": 12, "engine": "vectorized"}
    fedac = run_rounds(prepare(cfg_of({"name": "fedac", "k": 1, "mu": 0.5, "lam": 0.0, "split_threshold": 1e9}, **over),
                               tmp_path))
    prox = run_rounds(prepare(cfg_of({"name": "fedprox", "mu": 0.5, "weighting": "uniform"}, **over), tmp_path))
    assert fedac.k == 1 and rel_err(fedac.models, prox.models) < 1e-6


def test_the_embedding_pull_keeps_phi_near_the_global_embedding(tmp_path):
    """λ > 0 (μ = 0): after a round, the clients' φ stayed closer to Φ^0 = φ^0 than without the pull."""
    over = {"rounds": 1, "engine": "vectorized", "lr": 0.05}
    runs = {lam: run_rounds(prepare(cfg_of({"name": "fedac", "mu": 0.0, "lam": lam, "split_threshold": 1e9}, **over),
                                    tmp_path)) for lam in (0.0, 5.0)}
    prep = prepare(cfg_of({"name": "fedac"}), tmp_path)
    lay = prep.algorithm.layout(prep.ctx)
    phi = lay.columns(lay.embedding)
    drift = {lam: float((s.algo["omega"].gather(np.flatnonzero(s.algo["omega"].written()))["omega"][:, phi] - s.algo["omega0"][phi]).norm()) for lam, s in runs.items()}
    assert drift[5.0] < 0.9 * drift[0.0]


def test_local_spec_pulls_phi_towards_omega_and_phi_and_h_towards_omega(tmp_path):
    """μ(ω − Ω_k*) + λ(φ − Φ) as one proximal term per parameter: μ + λ towards (μΩ_φ + λΦ)/(μ + λ)
    on φ, μ towards Ω_h on h; every client starts from its own ω_i."""
    prep = prepare(cfg_of({"name": "fedac", "k": 2, "mu": 0.3, "lam": 0.1}, rounds=2), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = run_rounds(prep)
    lay = alg.layout(ctx)
    clients = np.arange(12)
    spec = alg.local_spec(state, ctx, clients, 2)
    assert spec.prox_mu == {"1.weight": pytest.approx(0.4), "1.bias": pytest.approx(0.4), "3.weight": 0.3, "3.bias": 0.3}
    which = alg.model_of(state, ctx, clients)
    assert (which[state.assignments >= 0] == state.assignments[state.assignments >= 0]).all()
    phi = lay.unflatten(torch.zeros(1, lay.dim).index_copy_(1, lay.columns(lay.embedding), state.algo["phi"][None]))
    for name in lay.names:
        omega = state.models[name][torch.from_numpy(which)]
        want = (0.3 * omega + 0.1 * phi[name]) / 0.4 if name in lay.embedding else omega
        torch.testing.assert_close(spec.prox_anchor[name], want)
    torch.testing.assert_close(lay.flatten(spec.init), alg.omegas(state, clients))


@pytest.mark.parametrize("engine", ["reference", "vectorized"])
def test_a_per_parameter_mu_equal_everywhere_is_the_scalar_mu(tmp_path, engine):
    """The engine's per-parameter proximal weight (a dict) changes nothing for a uniform μ."""
    import dataclasses

    from flockfl.engine import TRAINERS, LocalSpec

    prep = prepare(cfg_of({"name": "fedavg"}), tmp_path)
    ctx = prep.ctx
    init = {k: v.expand(3, *v.shape[1:]).clone() for k, v in prep.algorithm.init_state(ctx).models.items()}
    anchor = {k: v + 0.1 for k, v in init.items()}
    spec = LocalSpec(np.arange(3), init, 0.1, 1, None, 16, prox_mu=0.7, prox_anchor=anchor)
    per = dataclasses.replace(spec, prox_mu={k: 0.7 for k in init})
    a, b = (TRAINERS[engine](ctx.model, s, ctx.data.train, ctx.data.task, 3, 0) for s in (spec, per))
    assert all(torch.equal(a.params[k], b.params[k]) for k in init)
    none = dataclasses.replace(spec, prox_mu={k: 0.0 for k in init})
    assert not none.has_extras and not none.has_prox


# ---------------------------------------------------------------------- the split and the keys


def test_split_layout_defaults_and_decision_layers():
    mlp = build_model("mlp", (1, 8, 8), 10, 16)
    lay = split_layout(mlp)
    assert lay.embedding == ("1.weight", "1.bias") and lay.decision == ("3.weight", "3.bias") and lay.dim == 1210
    assert split_layout(mlp, 2).embedding == () and len(split_layout(mlp, 2).decision) == 4
    lenet = build_model("lenet5", (1, 8, 8), 10)
    lay = split_layout(lenet)
    assert lay.embedding == ("0.weight", "0.bias", "3.weight", "3.bias")
    assert lay.decision == ("7.weight", "7.bias", "9.weight", "9.bias", "11.weight", "11.bias")
    assert split_layout(lenet, 1).decision == ("11.weight", "11.bias")
    with pytest.raises(ConfigError, match=r"^algorithm.decision_layers: 3 exceeds the 2 Linear layers"):
        split_layout(mlp, 3)
    x = torch.randn(3, lay.dim)
    assert torch.equal(lay.flatten(lay.unflatten(x)), x)


def test_an_empty_embedding_runs_without_the_lambda_term(tmp_path):
    state = run_rounds(prepare(cfg_of({"name": "fedac", "decision_layers": 2, "lam": 1.0}, rounds=2), tmp_path))
    assert state.algo["phi"].numel() == 0 and state.history[-1]["k_clusters"] == state.k


BAD = [("k", 0), ("k", 1.5), ("mu", -0.1), ("lam", -1), ("lam", "big"), ("components", 0), ("center_before_project", "yes"),
       ("pca_refresh_every", 0), ("lrcos_on", "embedding"), ("e_step", "some"), ("merge_threshold", -0.1),
       ("split_threshold", 0), ("cnt_warmup", -1), ("cnt_every", 0), ("decision_layers", 0), ("weighting", "n_i")]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_bad_values_are_one_line_errors(key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "fedac", key: value}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}: {value!r} is not allowed for fedac; allowed: ")
    assert "\n" not in msg


def test_split_threshold_must_exceed_merge_threshold():
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "fedac", "merge_threshold": 0.5, "split_threshold": 0.5}))
    assert str(err.value).startswith("config error: algorithm.split_threshold: 0.5 must exceed") and "\n" not in str(err.value)


def test_defaults_are_the_spec_placeholders():
    a = validate(tiny_config(algorithm={"name": "fedac"})).algorithm
    assert (a.k, a.mu, a.lam, a.components, a.merge_threshold, a.split_threshold, a.pca_refresh_every) == \
        (4, 0.01, 0.01, None, 0.1, 1.0, 1)
    assert (a.center_before_project, a.lrcos_on, a.e_step, a.weighting, a.decision_layers) == \
        (False, "model", "all", "samples", None)
