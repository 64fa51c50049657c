"""``auto`` thresholds and cluster counts (flockfl.clustering.choose, flockfl.algorithms.auto):
the criterion on hand-made proximity matrices with known structure (and none), the one-shot
methods (PACFL, FLIS-HC) and FLIS-DC choosing β from their own evidence, the evidence in the
state, ``flockfl run --json`` and MLflow, resume, newcomers, and bad values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, last_json, run_flock, tiny_config

from flockfl.clustering import ari
from flockfl.clustering.choose import FLOOR, choose_cut, choose_kmeans, cosine_distance
from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds


def blocks(sizes, within, between, noise=0.0, seed=0):
    """A distance matrix: ``within`` inside each group, ``between`` across (a matrix for nested
    levels), plus symmetric uniform noise."""
    g = np.repeat(np.arange(len(sizes)), sizes)
    b = np.asarray(between, float)
    d = b[g][:, g] if b.ndim == 2 else np.where(g[:, None] == g[None, :], within, between).astype(float)
    if b.ndim == 2:
        d = np.where(g[:, None] == g[None, :], within, d)
    rng = np.random.default_rng(seed)
    e = rng.uniform(0, noise, d.shape)
    d = d + (e + e.T) / 2
    np.fill_diagonal(d, 0)
    return d, g


@pytest.mark.parametrize("linkage", ["weighted", "average", "complete", "single"])
def test_three_clear_groups_are_found_with_their_threshold(linkage):
    d, g = blocks([5, 7, 6], 1.0, 10.0, noise=0.5)
    c = choose_cut(d, linkage)
    assert c.k == 3 and ari(g, c.labels) == 1.0
    # the threshold lies between the groups' spread and their distance: cutting there gives them back
    assert 1.0 < c.value < 10.0
    assert c.score > FLOOR and c.margin > 0
    assert [p["k"] for p in c.curve] == sorted(p["k"] for p in c.curve)


@pytest.mark.parametrize("seed", range(3))
def test_no_structure_gives_one_cluster(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(30, 64))  # isotropic clients: nothing to find
    d = np.linalg.norm(x[:, None] - x[None], axis=-1)
    for c in (choose_cut(d, "weighted"), choose_cut(d, "complete"), choose_kmeans(x, seed)):
        assert c.k == 1 and (c.labels == 0).all() and c.value is None
        assert c.score <= FLOOR and c.margin > 0
    # identical clients (all distances zero) too
    assert choose_cut(np.zeros((8, 8)), "average").k == 1


def test_nested_groups_resolve_to_the_finest_clear_level():
    # four groups in two pairs: within 1, inside a pair 4, across pairs 12 (PACFL on rotated digits)
    across = np.array([[0, 4, 12, 12], [4, 0, 12, 12], [12, 12, 0, 4], [12, 12, 4, 0]], float)
    d, g = blocks([6, 6, 6, 6], 1.0, across, noise=0.3)
    c = choose_cut(d, "weighted")
    assert c.k == 4 and ari(g, c.labels) == 1.0
    two = [p for p in c.curve if p["k"] == 2][0]
    # the coarse level has the best mean silhouette; its halves still hold reasonable structure
    assert two["score"] > c.score and two["worst_cluster"] > 0.5
    assert "nested" in c.reason


def test_a_noisy_group_is_not_shredded():
    # three far groups, each with weak inner structure (two loose halves): stays 3 clusters
    rng = np.random.default_rng(1)
    pts = np.concatenate([rng.normal(size=(8, 8)) * 0.5 + np.eye(8)[i] * 20 for i in range(3)])
    pts[::2] += 0.4  # a weak sub-structure inside each group
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    c = choose_cut(d, "average")
    assert c.k == 3


def test_too_few_clients_keep_one_cluster_and_say_why():
    c = choose_cut(np.array([[0.0, 5.0], [5.0, 0.0]]), "single")
    assert c.k == 1 and "too few" in c.reason


def test_kmeans_finds_blobs_and_cosine_distance():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 20)) * 10
    g = np.repeat(np.arange(4), 8)
    x = centres[g] + rng.normal(size=(32, 20))
    c = choose_kmeans(x, 0)
    assert c.k == 4 and ari(g, c.labels) == 1.0
    cd = cosine_distance(x)
    assert np.allclose(np.diag(cd), 0) and cd.max() <= 2 + 1e-12
    assert choose_kmeans(x, 0, dist=cd).k == 4


def test_a_broken_matrix_is_a_clear_error():
    with pytest.raises(ValueError, match="NaN or inf"):
        choose_cut(np.full((4, 4), np.nan), "average")
    with pytest.raises(ValueError, match="square"):
        choose_cut(np.zeros((3, 4)), "average")


# ---------------------------------------------------------------------- the methods

DISJOINT = {"scheme": "sc_niid", "rho": 100, "sc_clusters": 3, "num_clients": 15, "server_holdout": 300}


def cfg_of(algo: dict, partition: dict | None = None, **train):
    return validate(tiny_config(model={"hidden": 32}, algorithm=algo, partition=partition or DISJOINT,
                                train={"rounds": 2, "clients_per_round": 15, "local_epochs": 10, "batch_size": 10,
                                       "lr": 0.1, **train}))


@pytest.mark.parametrize("algo", [{"name": "pacfl", "beta": "auto"},
                                  {"name": "flis_hc", "beta": "auto", "server_data_size": 300}],
                         ids=["pacfl", "flis_hc"])
def test_one_shot_methods_find_disjoint_label_groups(tmp_path, algo):
    prep = prepare(cfg_of(algo), tmp_path)
    state = run_rounds(prep, until=1)
    truth = prep.ctx.data.group[prep.ctx.seen]
    assert ari(truth, state.assignments[prep.ctx.seen]) == 1.0 and state.k == 3
    rec = state.meta["auto_choices"][-1]
    assert rec["key"] == "algorithm.beta" and rec["round"] == -1 and rec["k"] == 3
    assert rec["criterion"] == "silhouette" and rec["margin"] > 0 and rec["curve"]
    # the chosen β is the one in force (PACFL: newcomers use it), and cutting at it gives the clusters
    used = float(state.algo["beta_used"])
    assert used == pytest.approx(rec["value"])
    if algo["name"] == "pacfl":
        prox = state.algo["matrices"]["pacfl_proximity"].numpy()
        again = run_rounds(prepare(cfg_of({**algo, "beta": used}), tmp_path), until=1)
        assert ari(again.assignments[prep.ctx.seen], state.assignments[prep.ctx.seen]) == 1.0
        assert prox.shape == (15, 15)


def test_iid_clients_get_one_cluster(tmp_path):
    prep = prepare(cfg_of({"name": "pacfl", "beta": "auto"}, {"scheme": "iid", "num_clients": 15}), tmp_path)
    state = run_rounds(prep, until=1)
    assert state.k == 1 and state.meta["auto_choices"][-1]["value"] is None
    assert float(state.algo["beta_used"]) == float("inf")


def test_flis_dc_decides_every_round_and_logs_it(tmp_path):
    cfg = cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300})
    state = run_rounds(prepare(cfg, tmp_path))
    recs = state.meta["auto_choices"]
    assert [r["round"] for r in recs] == [0, 1]
    assert all(r["chosen_k"] == 3 for r in recs)
    # a round's choice counts once the round before found the same partition: round 0 runs with β = 0
    assert recs[0]["k"] == 1 and recs[0]["value"] == 0.0 and "not yet confirmed" in recs[0]["reason"]
    assert recs[1]["k"] == 3 and 0 < recs[1]["value"] < 1
    assert state.history[-1]["auto_k"] == 3 and state.history[-1]["auto_margin"] > 0
    assert float(state.algo["beta_used"]) == pytest.approx(recs[-1]["value"])


def test_flis_dc_auto_confirms_across_rounds_under_partial_participation(tmp_path):
    """5 of 15 clients a round: consecutive cohorts share about two clients, too few to confirm a
    partition of the cohort. The decision's window (the latest predictions of up to auto_window
    clients, newest first) shares ten clients with the round before, so the three groups are
    confirmed and β > 0 once the window holds every group's clients twice running."""
    cfg = cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300, "auto_window": 15},
                 rounds=6, clients_per_round=5)
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    recs = state.meta["auto_choices"]
    sizes = [r["window"] for r in recs]  # every distinct client seen so far, up to 15
    assert sizes[0] == 5 and sizes == sorted(sizes) and sizes[-1] > 10
    held = state.algo["flis_window_clients"].numpy()
    assert len(np.unique(held)) == len(held) == sizes[-1] and state.algo["flis_window_b"].shape[0] == sizes[-1]
    confirmed = [r for r in recs if r["k"] > 1]
    assert recs[-1]["k"] == 3 and all(r["k"] <= 3 and 0 < r["value"] < 1 for r in confirmed)  # groups as they are seen
    assert float(state.algo["beta_used"]) == pytest.approx(recs[-1]["value"])
    # the window's groups are the true ones
    truth = prep.ctx.data.group
    last = state.meta["flis_auto_last"]
    assert ari(truth[np.array(last["clients"])], np.array(last["labels"])) == 1.0
    # deciding on the cohort alone (auto_window = the cohort) is never confirmed here
    alone = run_rounds(prepare(cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300, "auto_window": 5},
                                      rounds=6, clients_per_round=5), tmp_path))
    assert all(r["k"] == 1 for r in alone.meta["auto_choices"])


def test_flis_dc_keeps_the_beta_in_force_until_a_new_choice_is_confirmed(tmp_path):
    """A round whose choice differs from the round before's changes nothing: the last confirmed β
    stays (not FedAvg's 0), and the record says so."""
    prep = prepare(cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300}), tmp_path)
    state = run_rounds(prep)
    in_force = float(state.algo["beta_used"])
    assert 0 < in_force < 1
    result = type("R", (), {})()
    result.clients = np.arange(15)
    result.params = {k: v[torch.from_numpy(state.assignments)] for k, v in state.models.items()}
    other = {"round": state.round - 1, "clients": list(range(15)), "labels": [0] * 7 + [1] * 8}
    held = state.replace(meta={**state.meta, "flis_auto_last": other})
    clusters, _, choice, beta, _ = prep.algorithm.overlapping_clusters(held, prep.ctx, result)
    assert beta == in_force and choice.chosen.k == 3 and choice.k == len(clusters)
    assert "the β in force stays" in choice.reason
    # the same evidence, confirmed by the round before, is taken
    same = {**other, "labels": choice.chosen.labels.tolist()}
    _, _, taken, beta2, _ = prep.algorithm.overlapping_clusters(state.replace(meta={**state.meta, "flis_auto_last": same}),
                                                                prep.ctx, result)
    assert taken.k == 3 and beta2 == pytest.approx(1 - taken.value) and "stays" not in taken.reason


def test_flis_dc_window_resumes_bit_identical(tmp_path):
    cfg = cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300, "auto_window": 15},
                 rounds=4, clients_per_round=5, engine="vectorized")
    full, resumed = assert_resume_bit_identical(cfg, tmp_path, until=2)
    assert resumed.meta["auto_choices"] == full.meta["auto_choices"]
    assert np.array_equal(resumed.algo["flis_window_clients"], full.algo["flis_window_clients"])


def test_flis_dc_runs_the_clients_models_on_its_data_once_a_round(tmp_path, monkeypatch):
    """cluster and aggregate need the same overlapping clusters: the server's inference pass runs
    once a round (it is FLIS-DC's largest server cost), and a changed model is never served from
    the first answer."""
    from flockfl.algorithms.flis import FLISDC

    calls = []
    original = FLISDC.inferences
    monkeypatch.setattr(FLISDC, "inferences", lambda self, ctx, params: calls.append(1) or original(self, ctx, params))
    prep = prepare(cfg_of({"name": "flis_dc", "beta": "auto", "server_data_size": 300}, rounds=3), tmp_path)
    state = run_rounds(prep)
    assert len(calls) == 3 and len(state.meta["auto_choices"]) == 3
    algo, result = prep.algorithm, type("R", (), {})()
    result.clients, result.params = np.arange(4), {k: v[:1].repeat(4, *[1] * (v.dim() - 1)) for k, v in state.models.items()}
    first = algo.overlapping_clusters(state, prep.ctx, result)
    result.params = {k: v + 0.01 for k, v in result.params.items()}
    algo.overlapping_clusters(state, prep.ctx, result)
    assert len(calls) == 5 and len(first[0]) == 1  # identical models: one cluster; changed ones: computed again


@pytest.mark.parametrize("algo", [{"name": "pacfl", "beta": "auto"},
                                  {"name": "flis_dc", "beta": "auto", "server_data_size": 300}], ids=["pacfl", "flis_dc"])
def test_resume_with_auto_is_bit_identical(tmp_path, algo):
    full, resumed = assert_resume_bit_identical(cfg_of(algo, rounds=3, engine="vectorized"), tmp_path, until=1)
    assert resumed.meta["auto_choices"] == full.meta["auto_choices"]


def test_newcomers_use_the_chosen_beta(tmp_path):
    cfg = cfg_of({"name": "pacfl", "beta": "auto"}, {**DISJOINT, "num_clients": 24, "unseen_fraction": 0.25},
                 clients_per_round=18)
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    info = state.driver.newcomers
    truth = prep.ctx.data.group
    old = prep.ctx.seen
    # each newcomer joins the cluster of its true group (PME with the chosen β)
    by_group = {int(truth[c]): int(state.assignments[c]) for c in old}
    assert len(by_group) == 3 and state.k == 3 and len(info["clients"]) == 6
    assert [by_group[int(truth[c])] for c in info["clients"]] == list(info["clusters"])
    assert "β=" in info["rule"]


@pytest.mark.parametrize("value, name, words", [
    ("automatic", "pacfl", "algorithm.beta: 'automatic' is not allowed for pacfl; allowed: 0 < x, or auto"),
    ("Auto", "flis_hc", "algorithm.beta: 'Auto' is not allowed for flis_hc"),
])
def test_bad_values_are_one_line(value, name, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(tiny_config(algorithm={"name": name, "beta": value}))


def test_auto_beta_and_k_together_are_refused():
    with pytest.raises(ValueError, match="auto chooses the number of clusters itself"):
        validate(tiny_config(algorithm={"name": "pacfl", "beta": "auto", "k": 2}))


@pytest.mark.slow  # a whole flockfl run with MLflow (64 s in the parallel suite): the full suite's, not the fast tier's
def test_the_cli_prints_and_logs_the_evidence(workdir):
    out = run_flock(["run", "digits_dirichlet", "--json", "--no-progress",
                     "--set", "dataset.name=digits", "--set", "model.name=mlp", "--set", "model.hidden=32",
                     "--set", "partition.scheme=sc_niid", "--set", "partition.rho=100", "--set", "partition.sc_clusters=3",
                     "--set", "partition.num_clients=15", "--set", "train.rounds=1", "--set", "train.clients_per_round=5",
                     "--set", "algorithm.name=pacfl", "--set", "algorithm.beta=auto"], workdir)
    assert out.returncode == 0, out.stderr
    summary = last_json(out.stdout)
    latest = summary["auto"]["latest"][0]
    assert summary["auto"]["decisions"] == 1 and latest["k"] == 3 and latest["curve"] and latest["margin"] > 0
    import mlflow

    client = mlflow.MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.data.metrics["auto_k"] == 3 and run.data.metrics["auto_margin"] == pytest.approx(latest["margin"])
    arts = {a.path for a in client.list_artifacts(summary["run_id"], "plots")} | {
        a.path for a in client.list_artifacts(summary["run_id"])}
    assert "plots/auto_choice.png" in arts and "auto_choices.json" in arts
    got = json.loads(open(client.download_artifacts(summary["run_id"], "auto_choices.json", str(workdir))).read())
    assert got["decisions"][0]["k"] == 3
    bad = run_flock(["run", "digits_dirichlet", "--set", "algorithm.name=pacfl", "--set", "algorithm.beta=automatic"],
                    workdir)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "or auto" in bad.stderr


# ---------------------------------------------------------------------- methods that train first

SWAP = {"scheme": "label_swap", "k": 4, "label_swap_mode": "random_perm"}
ROTATED = {"scheme": "rotated", "k": 4, "rotated_mode": "disjoint"}


def digits32(algo: dict, partition: dict, rounds: int):
    """32 digits clients, all training every round (the CFL tests' setting)."""
    return validate(tiny_config(algorithm=algo, partition={"num_clients": 32, **partition},
                                train={"rounds": rounds, "clients_per_round": 32, "lr": 0.3, "local_epochs": 2}))


def final_ari(state, prep) -> float:
    seen = prep.ctx.seen
    return ari(prep.ctx.data.group[seen], state.assignments[seen])


@pytest.mark.parametrize("partition, k", [(SWAP, 4), ({"scheme": "iid"}, 1)], ids=["label_swap", "iid"])
def test_cfl_auto_split_finds_the_groups_and_leaves_iid_whole(tmp_path, partition, k):
    prep = prepare(digits32({"name": "cfl", "eps1": "auto", "eps2": "auto", "warmup_rounds": 0}, partition, 24), tmp_path)
    state = run_rounds(prep)
    assert state.k == k
    if k > 1:
        assert final_ari(state, prep) >= 0.95
        # every split was confirmed by two consecutive tests, and is in the evidence
        confirmed = [r for r in state.meta["auto_choices"] if r["confirmed"]]
        assert len(confirmed) == len(state.meta["cfl_splits"]) == k - 1
        assert all(r["k"] >= 2 and r["score"] > FLOOR for r in confirmed)
    assert sum(h["auto_tests"] for h in state.history) == len(state.meta["auto_choices"]) > 0


@pytest.mark.parametrize("partition, k", [(ROTATED, 4), ({"scheme": "iid"}, 1)], ids=["rotated", "iid"])
def test_fedac_auto_k_tracks_the_groups(tmp_path, partition, k):
    prep = prepare(digits32({"name": "fedac", "k": "auto"}, partition, 8), tmp_path)
    state = run_rounds(prep)
    assert state.k == k and [r["round"] for r in state.meta["auto_choices"]] == list(range(8))
    assert state.history[-1]["auto_k"] == k == state.history[-1]["k_clusters"]
    if k > 1:
        assert final_ari(state, prep) == 1.0


@pytest.mark.parametrize("algo", [{"name": "ifca", "k": "auto", "init": "pretrain_kmeans"},
                                  {"name": "ifca", "k": "auto", "init": "pretrain_kmeans", "pretrain_embedding": "edc"},
                                  {"name": "flexcfl", "k": "auto"},
                                  {"name": "flexcfl", "k": "auto", "group_init": "madc"}],
                         ids=["ifca-layers", "ifca-edc", "flexcfl-edc", "flexcfl-madc"])
def test_pre_federation_k_from_the_updates(tmp_path, algo):
    for partition, k in ((ROTATED, 4), ({"scheme": "iid"}, 1)):
        prep = prepare(digits32(algo, partition, 1), tmp_path)
        state = run_rounds(prep)
        rec = state.meta["auto_choices"][0]
        assert rec["key"] == "algorithm.k" and rec["round"] == -1 and rec["k"] == k == state.k
        clients, labels = state.algo["pretrain_clients"].numpy(), state.algo["pretrain_labels"].numpy()
        assert len(clients) == 32  # k unknown: every federating client pre-trains
        if k > 1:
            assert ari(prep.ctx.data.group[clients], labels) == 1.0


@pytest.mark.parametrize("algo", [{"name": "cfl", "eps1": "auto", "eps2": "auto", "warmup_rounds": 1},
                                  {"name": "fedac", "k": "auto"},
                                  {"name": "ifca", "k": "auto", "init": "pretrain_kmeans"},
                                  {"name": "flexcfl", "k": "auto"}], ids=["cfl", "fedac", "ifca", "flexcfl"])
def test_resume_with_auto_keys_is_bit_identical(tmp_path, algo):
    cfg = validate(tiny_config(algorithm=algo, train={"rounds": 4, "clients_per_round": 6}))
    full, resumed = assert_resume_bit_identical(cfg, tmp_path, until=2)
    assert resumed.meta["auto_choices"] == full.meta["auto_choices"] and full.meta["auto_choices"]


@pytest.mark.parametrize("algo, words", [
    ({"name": "cfl", "eps1": "auto"}, "set both to auto or neither"),
    ({"name": "ifca", "k": "auto"}, "only init=pretrain_kmeans makes"),
    ({"name": "flexcfl", "k": "auto", "group_init": "rcc"}, "group_init=rcc"),
    ({"name": "difca", "k": "auto"}, "algorithm.k: 'auto' is not allowed for difca"),
    ({"name": "fesem", "k": "auto"}, "algorithm.k: 'auto' is not allowed for fesem"),
])
def test_auto_where_it_cannot_work_is_one_line(algo, words):
    with pytest.raises(ValueError, match=words):
        validate(tiny_config(algorithm=algo))


def test_flexcfl_auto_redecides_when_the_detector_fires(tmp_path):
    # swaps move clients between the groups that exist: the re-decision keeps m and is in the evidence
    cfg = validate(tiny_config(algorithm={"name": "flexcfl", "k": "auto"}, partition={"num_clients": 32, **SWAP},
                               shift={"kind": "swap_all", "probability": 0.5, "start_round": 1},
                               train={"rounds": 3, "clients_per_round": 32, "lr": 0.3, "local_epochs": 2}))
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    shifted = [r for r in state.meta["auto_choices"] if r["round"] >= 1]
    assert shifted and all(r["shifted_clients"] > 0 and r["groups_born"] == 0 for r in shifted)
    assert sum(h["clients_shift_detected"] for h in state.history) == sum(r["shifted_clients"] for r in shifted)
    assert state.k == state.meta["auto_choices"][0]["k"] == 4


def test_flexcfl_redecision_opens_a_group_for_a_distribution_no_group_has(tmp_path):
    import torch

    prep = prepare(validate(tiny_config(algorithm={"name": "flexcfl", "k": "auto"},
                                        train={"rounds": 1, "clients_per_round": 6})), tmp_path)
    state = run_rounds(prep, until=1)
    alg, m = prep.algorithm, state.k
    dirs = state.algo["directions"].numpy()
    rng = np.random.default_rng(0)
    fresh = rng.normal(size=dirs.shape[1])
    q, _ = np.linalg.qr(np.concatenate([dirs.T, fresh[:, None]], 1))
    new_dir = q[:, -1] * np.linalg.norm(dirs[0])  # orthogonal to every group's direction
    delta = np.concatenate([new_dir + 0.01 * rng.normal(size=(4, dirs.shape[1])) * np.linalg.norm(dirs[0]),
                            dirs[0] + 0.01 * rng.normal(size=(4, dirs.shape[1])) * np.linalg.norm(dirs[0])])
    params = {k: v[:1].expand(8, *v.shape[1:]).clone() for k, v in state.models.items()}
    eq8 = np.zeros(8, np.int64)
    new, groups = alg.redecide(state, prep.ctx, np.arange(8), eq8, params, delta, 1)
    assert new.k == m + 1 and (groups[:4] == m).all() and (groups[4:] == 0).all()
    rec = new.meta["auto_choices"][-1]
    assert rec["groups_born"] == 1 and rec["round"] == 1
    assert torch.allclose(new.algo["directions"][-1], torch.from_numpy(delta[:4].mean(0)))
