"""Curricula (thesis Chapter 2, spec §1): the pacing families of Table 2.1 by hand, paced
batches, ranking, both trainers agreeing with every local-training extra switched on, the
stage composing with five algorithms, every scoring function, the client curriculum, the
expert, Algorithm 2, and bit-identical resume."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, rel_err, spy, tiny_config

from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.engine import train_cohort, train_reference
from flockfl.engine.pacing import Pacing, paced_batches, pacing_size
from flockfl.engine.schedule import LocalSpec, client_batches, cohort_schedule
from flockfl.rng import torch_generator
from flockfl.rounds import prepare, run_rounds, select_stage
from flockfl.stages.curriculum import client_losses, rank

FAMILIES = ("exp", "step", "root", "linear", "quad")


def cfg_of(curriculum=None, algo=None, partition=None, model=None, pruning=None, **train):
    return validate(tiny_config(
        curriculum=curriculum or {}, algorithm=algo or {"name": "fedavg"}, pruning=pruning or {},
        partition=partition or {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 10},
        model=model or {"name": "mlp", "hidden": 16},
        train={"rounds": 3, "clients_per_round": 5, "batch_size": 16, "eval_finetune": "off", "threads": 1, **train}))


# ---------------------------------------------------------------------- 1. pacing families


def table_2_1(family, t, n, big_t, a, b, literal):
    """Table 2.1 written out again, independently of the code: the raw expression (no ⌈·⌉, no clip)."""
    at = a * big_t
    grow = (n - b) if literal else n * (1 - b)
    if family == "exp":  # the printed exponential row already uses N(1 − b)
        return n * b + n * (1 - b) / (math.e**10 - 1) * (math.e ** (10 * t / at) - 1)
    if family == "step":
        return n * b + n * math.floor(t / at)
    if family == "root":
        return n * b + grow / math.sqrt(at) * math.sqrt(t)
    if family == "linear":
        return n * b + grow / at * t
    return n * b + grow / at**2 * t**2


# N = 100, T = 50, a = 0.8, b = 0.2: aT = 40. Hand-computed values (⌈·⌉ and clipped to [1, 100]).
HAND = {
    # family: {t: (corrected, literal)}
    "linear": {0: (20, 20), 10: (40, 45), 20: (60, 70), 30: (80, 95), 40: (100, 100), 47: (100, 100)},
    "root": {0: (20, 20), 10: (60, 70), 20: (77, 91), 40: (100, 100), 47: (100, 100)},
    "quad": {0: (20, 20), 10: (25, 27), 20: (40, 45), 30: (65, 77), 40: (100, 100), 47: (100, 100)},
    "exp": {0: (20, 20), 10: (21, 21), 20: (21, 21), 30: (27, 27), 39: (83, 83), 40: (100, 100), 47: (100, 100)},
    "step": {0: (20, 20), 20: (20, 20), 39: (20, 20), 40: (100, 100), 47: (100, 100)},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_pacing_families_match_table_2_1_at_hand_picked_points(family):
    for t, (corrected, literal) in HAND[family].items():
        assert pacing_size(family, t, 100, 50, 0.8, 0.2) == corrected, (family, t)
        assert pacing_size(family, t, 100, 50, 0.8, 0.2, literal=True) == literal, (family, t)
        # and the formula written out again agrees with the hand value
        for lit, want in ((False, corrected), (True, literal)):
            assert min(100, max(1, math.ceil(table_2_1(family, t, 100, 50, 0.8, 0.2, lit) - 1e-9))) == want


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n,big_t,a,b", [(100, 50, 0.8, 0.2), (37, 13, 0.5, 0.3), (500, 500, 0.1, 0.0025),
                                         (7, 3, 1.0, 0.8), (10, 40, 0.3, 0.1), (1, 5, 0.5, 0.5)])
def test_pacing_invariants(family, n, big_t, a, b):
    at = a * big_t
    assert pacing_size(family, 0, n, big_t, a, b) == max(1, math.ceil(round(n * b, 9)))  # g(0) = ⌈N·b⌉
    assert pacing_size(family, at, n, big_t, a, b) == n  # g(aT) = N (corrected)
    for t in range(big_t + 3):  # clipped to [1, N], never decreasing, N from aT on; matches the formula
        g = pacing_size(family, t, n, big_t, a, b)
        assert 1 <= g <= n
        assert g >= pacing_size(family, max(t - 1, 0), n, big_t, a, b)
        if t >= at:
            assert g == n
        assert g == min(n, max(1, math.ceil(table_2_1(family, t, n, big_t, a, b, False) - 1e-9)))
        if family == "step" and t < at:
            assert g == max(1, math.ceil(round(n * b, 9)))  # constant N·b before aT
    for t in (0, 1, big_t // 2, big_t):  # a = 0 or b = 1: ordinary training
        assert pacing_size(family, t, n, big_t, 0.0, b) == n
        assert pacing_size(family, t, n, big_t, a, 1.0) == n
        assert pacing_size(family, t, n, big_t, 0.0, b, literal=True) == n


def test_literal_mode_overshoots_before_the_clip_and_b_zero_starts_at_one():
    # (N − b) growth: the linear row reaches N·b + N − b at aT, clipped to N; before that it is above the corrected one
    assert table_2_1("linear", 40, 100, 50, 0.8, 0.2, True) == pytest.approx(119.8)
    assert pacing_size("linear", 30, 100, 50, 0.8, 0.2, literal=True) > pacing_size("linear", 30, 100, 50, 0.8, 0.2)
    # exp and step print no (N − b): literal changes nothing there
    for fam in ("exp", "step"):
        assert [pacing_size(fam, t, 100, 50, 0.8, 0.2, True) for t in range(50)] == \
               [pacing_size(fam, t, 100, 50, 0.8, 0.2) for t in range(50)]
    assert pacing_size("linear", 0, 100, 50, 0.8, 0.0) == 1
    with pytest.raises(ValueError, match="unknown pacing family"):
        pacing_size("log", 1, 10, 10, 0.5, 0.5)


def test_pacing_global_clock_offsets_the_step():
    p = Pacing("linear", 0.8, 0.2, offset=30, total=50)
    assert [p.size(t, 100, 10) for t in (0, 5, 10)] == [pacing_size("linear", 30 + t, 100, 50, 0.8, 0.2) for t in (0, 5, 10)]
    assert Pacing("linear", 0.8, 0.2).size(5, 100, 50) == pacing_size("linear", 5, 100, 50, 0.8, 0.2)


# ---------------------------------------------------------------------- 2. paced batches


@pytest.mark.parametrize("family,a,b", [("linear", 0.8, 0.2), ("step", 0.5, 0.05), ("exp", 0.8, 0.2),
                                         ("root", 0.3, 0.5), ("quad", 1.0, 0.02)])
@pytest.mark.parametrize("n,batch,epochs,steps", [(37, 5, 3, None), (12, 16, 2, None), (50, 10, 1, 7), (23, 4, 2, 30)])
def test_paced_batches_stay_in_the_prefix_and_keep_the_vanilla_budget(family, a, b, n, batch, epochs, steps):
    pacing = Pacing(family, a, b)
    order = np.random.default_rng(n).permutation(n)
    spec = LocalSpec(np.arange(1), {}, 0.1, epochs=epochs, steps=steps, batch_size=batch, order=[order], pacing=pacing)
    batches = client_batches(n, spec, np.random.default_rng(1))
    bsz = min(batch, n)
    budget = steps if steps is not None else epochs * math.ceil(n / bsz)
    assert len(batches) == budget
    plain = client_batches(n, dataclasses.replace(spec, order=None), np.random.default_rng(1))
    assert len(plain) == budget  # the same number of steps as the vanilla schedule
    for t, idx in enumerate(batches):
        g = pacing.size(t, n, budget)
        assert set(idx.tolist()) <= set(order[:g].tolist()), (t, g)
        assert len(idx) == min(bsz, g) and len(set(idx.tolist())) == len(idx)  # distinct samples
    # a step whose prefix is no larger than the batch uses the whole prefix
    for t, idx in enumerate(batches):
        if pacing.size(t, n, budget) <= bsz:
            np.testing.assert_array_equal(idx, order[: pacing.size(t, n, budget)])
    # paced_batches directly gives the same draw
    direct = paced_batches(order, pacing, budget, bsz, np.random.default_rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(direct, batches))


def test_cohort_schedule_uses_each_clients_own_order():
    sizes = np.array([9, 30, 17])
    orders = [np.random.default_rng(c).permutation(int(s)) for c, s in enumerate(sizes)]
    spec = LocalSpec(np.arange(3), {}, 0.1, epochs=2, batch_size=4, order=orders, pacing=Pacing("linear", 0.8, 0.1))
    sched = cohort_schedule(spec, sizes, seed=5, round=1)
    for c, steps in enumerate(sched):
        assert len(steps) == 2 * math.ceil(sizes[c] / 4)
        assert set(steps[0].tolist()) <= set(orders[c][: spec.pacing.size(0, sizes[c], len(steps))].tolist())


# ---------------------------------------------------------------------- 3. rank


def test_rank_orders_and_ties():
    score = np.array([0.3, 2.0, 0.1, 5.0, 1.0, 0.7])
    curr = rank(score, "curr", np.random.default_rng(0))
    anti = rank(score, "anti", np.random.default_rng(0))
    assert curr.tolist() == [3, 1, 4, 5, 0, 2]  # highest score (easiest) first
    assert anti.tolist() == [2, 0, 5, 4, 1, 3]
    rnd = rank(score, "random", np.random.default_rng(0))
    assert sorted(rnd.tolist()) == list(range(6))
    assert {tuple(rank(score, "random", np.random.default_rng(s)).tolist()) for s in range(6)} != {tuple(rnd.tolist())}

    ties = np.array([1, 0, 1, 1, 0, 1, 0, 1, 1, 0], float)  # binary *_pred scores
    for ordering in ("curr", "anti", "random"):
        a = rank(ties, ordering, np.random.default_rng(7))
        b = rank(ties, ordering, np.random.default_rng(7))
        np.testing.assert_array_equal(a, b)  # the same seed breaks ties the same way
        assert sorted(a.tolist()) == list(range(10))
    c = rank(ties, "curr", np.random.default_rng(7))
    assert (ties[c][:6] == 1).all() and (ties[c][6:] == 0).all()
    assert (ties[rank(ties, "anti", np.random.default_rng(7))][:4] == 0).all()
    # ties are broken at random, not by index: some seed orders the tied block differently
    blocks = {tuple(rank(ties, "curr", np.random.default_rng(s))[:6].tolist()) for s in range(8)}
    assert len(blocks) > 1


# ---------------------------------------------------------------------- 4. both trainers, every extra


@pytest.mark.parametrize("model", ["mlp", "cnn_bn", "lenet5_bn"])
def test_trainers_agree_with_curriculum_masks_snapshot_and_gradient_terms(tmp_path, model):
    method = "unstructured" if model == "mlp" else "hybrid"
    cfg = cfg_of({"ordering": "curr", "pacing": "root", "a": 0.5, "b": 0.1}, model={"name": model, "hidden": 16},
                 pruning={"method": method}, local_epochs=2, batch_size=8)
    prep = prepare(cfg, tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    state, spec = select_stage(prep, state, 0)
    assert spec.order is not None and spec.masks is not None and spec.snapshot_steps is not None
    c = len(spec.clients)
    sizes = prep.ctx.data.train.sizes[spec.clients]
    assert len(set(sizes.tolist())) > 1  # unequal clients
    # random masks (weights and, for BN models, whole channels), an init restricted to them
    pr = prep.stages["pruning"]
    g = torch.Generator().manual_seed(11)
    w = {k: torch.rand(c, *pr.shapes[k], generator=g) > 0.3 for k in pr.unstructured}
    ch = {gr["bn"]: torch.rand(c, pr.shapes[f"{gr['bn']}.weight"][0], generator=g) > 0.25 for gr in pr.groups}
    masks = pr.full_masks(w, ch)
    init = {k: spec.init[k] * masks[k] if k in masks else spec.init[k].clone() for k in spec.init}
    corr = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in init.items()}
    assert c == 5
    # BN models on two cores are slow per step: a fixed budget of 6 steps (the mlp keeps E·⌈n/B⌉)
    steps = None if model == "mlp" else 6
    spec = dataclasses.replace(spec, init=init, masks=masks, prox_mu=0.3, correction=corr, momentum=0.5,
                               snapshot_steps=np.array([1, 3, 2, 5, 100]), steps=steps)
    data, task = prep.ctx.data.train, prep.ctx.data.task
    ref = train_reference(prep.ctx.model, spec, data, task, cfg.seed, 0)
    vec = train_cohort(prep.ctx.model, spec, data, task, cfg.seed, 0)
    assert rel_err(vec.params, ref.params) < 1e-5
    assert rel_err(vec.meta["snapshot"], ref.meta["snapshot"]) < 1e-5
    np.testing.assert_array_equal(vec.num_steps, ref.num_steps)
    np.testing.assert_array_equal(ref.num_steps, [steps or 2 * math.ceil(n / 8) for n in sizes])  # the vanilla budget
    assert rel_err(ref.params, init) > 1e-3  # training moved
    assert rel_err(ref.meta["snapshot"], ref.params) > 1e-4  # the snapshot is not the final model
    for res in (ref, vec):  # a pruned entry stays exactly 0; correction/prox never leak through the mask
        for k, m in masks.items():
            if k in {"bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"}:
                continue  # BN statistics are recomputed, not stepped
            assert (res.params[k][m == 0] == 0).all(), k
            assert (res.meta["snapshot"][k][m == 0] == 0).all(), k
    # a client whose snapshot comes at or after its last step gets its final parameters
    assert spec.snapshot_steps[4] >= ref.num_steps[4]
    for res in (ref, vec):
        for k in ref.params:
            if "running" not in k:
                torch.testing.assert_close(res.meta["snapshot"][k][4], res.params[k][4], rtol=0, atol=0)


def test_trainers_agree_on_a_curriculum_without_extras(tmp_path):
    """The plain curriculum path (no masks, no gradient terms) takes the vmap route, not dense."""
    cfg = cfg_of({"ordering": "anti", "pacing": "exp"}, local_epochs=2, batch_size=8)
    prep = prepare(cfg, tmp_path)
    state, spec = select_stage(prep, prep.algorithm.init_state(prep.ctx), 1)
    data, task = prep.ctx.data.train, prep.ctx.data.task
    ref = train_reference(prep.ctx.model, spec, data, task, cfg.seed, 1)
    vec = train_cohort(prep.ctx.model, spec, data, task, cfg.seed, 1)
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)


# ---------------------------------------------------------------------- 5. composition


ALGOS = [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}, {"name": "scaffold"}, {"name": "ifca", "k": 2},
         {"name": "pacfl", "k": 2}]


@pytest.mark.parametrize("algo", ALGOS, ids=[a["name"] for a in ALGOS])
def test_data_curriculum_composes_with_algorithms(tmp_path, algo):
    cur = run_rounds(prepare(cfg_of({"ordering": "curr"}, algo), tmp_path))
    van = run_rounds(prepare(cfg_of({"ordering": "vanilla"}, algo), tmp_path))
    assert len(cur.history) == 3
    for h in cur.history:
        assert "difficulty_std" in h and np.isfinite(h["difficulty_std"]) and h["difficulty_std"] > 0
        assert np.isfinite(h["accuracy"])
    assert all("difficulty_std" not in h for h in van.history)
    assert cur.digest() != van.digest()
    assert cur.meta["curriculum"]["ordering"] == "curr"


def test_a_curriculum_run_gives_the_same_models_on_both_engines(tmp_path):
    assert_trainers_agree(lambda e: cfg_of({"ordering": "curr", "pacing": "quad"}, {"name": "fedprox", "mu": 0.1},
                                           engine=e), tmp_path)


def test_orderings_differ_and_the_order_follows_the_score(tmp_path):
    digests = {o: run_rounds(prepare(cfg_of({"ordering": o}, rounds=2), tmp_path)).digest()
               for o in ("vanilla", "curr", "anti", "random")}
    assert len(set(digests.values())) == 4
    # with s_G, the order is the received model's per-sample loss, ascending for curr
    prep = prepare(cfg_of({"ordering": "curr"}), tmp_path)
    state, spec = select_stage(prep, prep.algorithm.init_state(prep.ctx), 0)
    losses = prep.stages["curriculum"].sample_losses(prep.ctx, state, spec)
    for i in range(len(spec.clients)):
        ordered = losses[i][1][np.asarray(spec.order[i])]
        assert (np.diff(ordered) >= -1e-12).all()


# ---------------------------------------------------------------------- 6. scoring functions


@pytest.mark.parametrize("scoring", ["s_G", "s_L", "s_LG", "s_G_pred", "s_L_pred", "s_LG_pred"])
def test_every_scoring_function_runs(tmp_path, scoring):
    st = run_rounds(prepare(cfg_of({"ordering": "curr", "scoring": scoring}), tmp_path))
    assert all(np.isfinite(h["difficulty_std"]) for h in st.history)
    assert np.isfinite(st.history[-1]["accuracy"])
    assert st.meta["curriculum"]["scoring"] == scoring


def test_s_L_persists_each_clients_last_local_model(tmp_path):
    cfg = cfg_of({"ordering": "curr", "scoring": "s_L"}, rounds=3)
    prep = prepare(cfg, tmp_path)
    calls = spy(prep.stages["curriculum"], "remember")
    st = run_rounds(prep)
    results = [result for _, result in calls]
    table = st.algo["curriculum"]["models"]
    trained = sorted({int(c) for r in results for c in r.clients})
    assert sorted(np.flatnonzero(table.written()).tolist()) == trained
    for r in results[-1:]:  # the last round's clients hold exactly their last local model
        rows = table.gather(r.clients)
        for k, v in rows.items():
            torch.testing.assert_close(v, r.params[k].cpu(), rtol=0, atol=0)
    # s_L with the persisted model differs from s_G once clients come back; with the received model it is s_G
    repeat = {int(c) for r in results[1:] for c in r.clients} & {int(c) for c in results[0].clients}
    assert repeat
    s_g = run_rounds(prepare(cfg_of({"ordering": "curr", "scoring": "s_G"}), tmp_path))
    received = run_rounds(prepare(cfg_of({"ordering": "curr", "scoring": "s_L", "local_model": "received"}), tmp_path))
    assert "curriculum" not in received.algo
    assert received.digest() == s_g.digest()
    assert any(not torch.equal(st.models[k], s_g.models[k]) for k in st.models)  # the models, not just the store


# ---------------------------------------------------------------------- 7. client curriculum


@pytest.mark.parametrize("b,pacing", [(0.5, "linear"), (0.2, "step"), (0.3, "root")])
def test_client_curriculum_pool_grows_by_the_pacing(tmp_path, b, pacing):
    rounds, k = 5, 4
    cfg = cfg_of({"clients": True, "b": b, "a": 0.8, "pacing": pacing}, rounds=rounds, clients_per_round=k)
    prep = prepare(cfg, tmp_path)
    seen_cohorts = []
    cur = prep.stages["curriculum"]
    orig = cur.cohort

    def select(ctx, state, alg, round):
        cohort, counts = orig(ctx, state, alg, round)
        loss = client_losses(ctx, state.models, np.maximum(state.assignments[ctx.seen], 0), ctx.seen)
        seen_cohorts.append((cohort, counts["client_pool"], loss))
        return cohort, counts

    cur.cohort = select
    st = run_rounds(prep)
    n = len(prep.ctx.seen)
    want = [pacing_size(pacing, r, n, rounds, 0.8, b) for r in range(rounds)]
    assert [h["client_pool"] for h in st.history] == want
    assert want == sorted(want) and want[-1] == n and want[0] < n
    assert [h["clients"] for h in st.history] == [min(k, p) for p in want]
    for cohort, pool, loss in seen_cohorts:  # the cohort comes from the pool of the easiest (lowest-loss) clients
        easiest = set(prep.ctx.seen[np.argsort(loss, kind="stable")[:pool]].tolist())
        assert set(cohort.tolist()) <= easiest and len(set(cohort.tolist())) == len(cohort)
    assert "client_pool" in st.meta["curriculum"]
    # the cohort has train.clients_per_round clients once the pool is big enough
    assert st.history[-1]["clients"] == k


def test_client_and_data_curriculum_together(tmp_path):
    cfg = cfg_of({"clients": True, "ordering": "anti", "b": 0.5}, rounds=3, clients_per_round=4)
    st = run_rounds(prepare(cfg, tmp_path))
    assert all("client_pool" in h and "difficulty_std" in h for h in st.history)
    assert st.meta["curriculum"]["client_ordering"] == "anti"


# ---------------------------------------------------------------------- 8. the expert


def test_s_E_reads_a_pt_file_and_a_checkpoint_and_a_missing_file_is_one_line(tmp_path):
    from flockfl.state import save_checkpoint
    from models import init_params

    prep = prepare(cfg_of(), tmp_path)
    good = init_params(prep.ctx.model, torch_generator(99, purpose="expert"))
    pt = tmp_path / "expert.pt"
    torch.save(good, pt)
    other = tmp_path / "other.pt"
    torch.save(init_params(prep.ctx.model, torch_generator(98, purpose="expert")), other)
    trained = run_rounds(prepare(cfg_of(rounds=1), tmp_path))
    ckpt = save_checkpoint(trained, tmp_path / "expert_run")

    runs = {}
    for name, src in (("pt", pt), ("other", other), ("ckpt", ckpt)):
        for key in ("scoring", "client_scoring"):
            c = {"ordering": "curr", "expert": str(src), **({"scoring": "s_E"} if key == "scoring" else
                                                             {"clients": True, "client_scoring": "s_E", "b": 0.5})}
            p = prepare(cfg_of(c, rounds=2), tmp_path)
            st = run_rounds(p)
            assert np.isfinite(st.history[-1]["accuracy"])
            runs[name, key] = st.digest()
            if name == "ckpt":  # the checkpoint's model 0 is the expert
                for k, v in p.stages["curriculum"].expert(p.ctx).items():
                    torch.testing.assert_close(v, trained.models[k][0])
            if name == "pt":
                for k, v in p.stages["curriculum"].expert(p.ctx).items():
                    torch.testing.assert_close(v, good[k])
    assert runs["pt", "scoring"] != runs["other", "scoring"] != runs["ckpt", "scoring"]

    with pytest.raises(ConfigError) as err:  # refused when the config is read, before any run directory exists
        cfg_of({"ordering": "curr", "scoring": "s_E", "expert": str(tmp_path / "missing.pt")}, rounds=1)
    msg = str(err.value)
    assert "curriculum.expert" in msg and "\n" not in msg and msg.strip()
    # expert=global is the current server model: s_E is then s_G
    same = [run_rounds(prepare(cfg_of({"ordering": "curr", "scoring": sc, "expert": "global"}, rounds=2), tmp_path)).digest()
            for sc in ("s_E", "s_G")]
    assert same[0] == same[1]
    # an expert of another model does not fit
    torch.save(init_params(prepare(cfg_of(model={"name": "mclr"}), tmp_path).ctx.model, torch_generator(1)),
               tmp_path / "mclr.pt")
    with pytest.raises(ConfigError, match="curriculum.expert") as err:
        run_rounds(prepare(cfg_of({"ordering": "curr", "scoring": "s_E", "expert": str(tmp_path / "mclr.pt")}, rounds=1),
                           tmp_path))
    assert "\n" not in str(err.value)


# a real MLflow store and a logged model (5-6 s): the full suite's
@pytest.mark.slow
def test_s_E_reads_an_mlflow_model_uri_through_the_readers_the_flow_passes(tmp_path):
    """The expert is one of the run's input files (``Stage.input_files``, read by the
    preparation like an algorithm's): an MLflow ``runs:/`` URI of a real SQLite store is read
    with the readers ``flockfl run`` passes (tasks.READERS), and the plain loop, given none, says
    in one line how to read it."""
    import mlflow
    import mlflow.pytorch
    from models import build_model, init_params

    import tasks

    cfg = cfg_of({"ordering": "curr", "scoring": "s_E", "expert": "global"}, rounds=1)
    net = build_model("mlp", (1, 8, 8), 10, 16)
    want = init_params(net, torch_generator(7, purpose="expert"))
    net.load_state_dict(want, strict=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as run:
        mlflow.pytorch.log_model(net, name="expert", serialization_format="pickle", pip_requirements=[])
    uri = f"runs:/{run.info.run_id}/expert"
    c = {"ordering": "curr", "scoring": "s_E", "expert": uri}
    prep = prepare(cfg_of(c, rounds=1), tmp_path, readers=tasks.READERS)
    got = prep.stages["curriculum"].expert(prep.ctx)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v.float())
    assert np.isfinite(run_rounds(prep).history[-1]["accuracy"])
    with pytest.raises(ConfigError, match=r"curriculum.expert: 'runs:/.*pass readers= to flockfl.preparation.prepare") as err:
        prepare(cfg_of(c, rounds=1), tmp_path)
    assert "\n" not in str(err.value)
    assert cfg.curriculum.expert == "global" and prepare(cfg, tmp_path).ctx.inputs == {}  # nothing to read


# ---------------------------------------------------------------------- 9. Algorithm 2


def _synthetic_partition(seed=0, n=240, classes=4, clients=5, cover=1.0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    idx = rng.permutation(n)[: int(cover * n)]
    cuts = np.sort(rng.choice(np.arange(1, len(idx)), clients - 1, replace=False))
    return y, [np.sort(p) for p in np.split(idx, cuts)]


def _counts(parts, y, classes):
    return np.array([[int((y[p] == c).sum()) for c in range(classes)] for p in parts])


@pytest.mark.parametrize("cover", [1.0, 0.7])
@pytest.mark.parametrize("f", [0.0, 0.5, 1.0, 0.3])
def test_algorithm_2_keeps_class_counts_and_deals_each_sample_once(f, cover):
    from flockfl.data.difficulty import reorder_by_difficulty

    y, parts = _synthetic_partition(cover=cover)
    loss = np.random.default_rng(1).random(len(y))
    exclude = np.setdiff1d(np.arange(len(y)), np.concatenate(parts))[:10]
    new = reorder_by_difficulty(parts, y, loss, f, np.random.default_rng(2), exclude)
    np.testing.assert_array_equal(_counts(new, y, 4), _counts(parts, y, 4))
    flat = np.concatenate(new)
    assert len(flat) == len(set(flat.tolist()))  # no sample given to two clients (or twice)
    assert not set(flat.tolist()) & set(exclude.tolist())  # the server's hold-out is never dealt
    again = reorder_by_difficulty(parts, y, loss, f, np.random.default_rng(2), exclude)
    assert all(np.array_equal(a, b) for a, b in zip(new, again))


def test_algorithm_2_at_f1_deals_contiguous_blocks_in_loss_order():
    from flockfl.data.difficulty import reorder_by_difficulty

    y, parts = _synthetic_partition(seed=3)
    loss = np.random.default_rng(4).permutation(len(y)).astype(float)  # distinct losses
    new = reorder_by_difficulty(parts, y, loss, 1.0, np.random.default_rng(0))
    counts = _counts(parts, y, 4)
    for c in range(4):
        d_c = np.flatnonzero(y == c)[np.argsort(loss[y == c])]  # easiest first
        start = 0
        for i, p in enumerate(new):
            mine = np.sort(p[y[p] == c])
            np.testing.assert_array_equal(mine, np.sort(d_c[start:start + counts[i, c]]))
            start += counts[i, c]
        # client 0 is the easiest within the class, then client 1, ...
        maxes = [loss[p[y[p] == c]].max() for p in new if (y[p] == c).any()]
        mins = [loss[p[y[p] == c]].min() for p in new if (y[p] == c).any()]
        assert all(a < b for a, b in zip(maxes[:-1], mins[1:]))


def test_algorithm_2_through_the_partition_config_on_digits(tmp_path):
    from flockfl.data import load_dataset
    from flockfl.data.difficulty import expert_losses
    from flockfl.data.schemes import make_partition

    base = cfg_of()
    ds = load_dataset(base.dataset, base.seed, base.partition.num_clients)
    ref = make_partition(ds, base)
    y = np.asarray(ds.y_train)
    want = _counts(ref.train_idx, y, 10)
    stds = {}
    for f in (0.0, 0.5, 1.0):
        cfg = cfg_of(partition={"scheme": "dirichlet", "alpha": 0.5, "num_clients": 10, "difficulty_fraction": f,
                                "difficulty_epochs": 3})
        part = make_partition(ds, cfg)
        np.testing.assert_array_equal(_counts(part.train_idx, y, 10), want)
        flat = np.concatenate(part.train_idx)
        assert len(flat) == len(set(flat.tolist()))
        info = part.info["difficulty"]
        assert info["f_ord"] == f and len(info["client_loss_std"]) == 10
        stds[f] = info["consistency_std_mean"]
        if f == 1.0:  # within every class, client 0 holds the easiest samples, then client 1, ...
            loss = expert_losses(ds, "mclr", 3, cfg.seed)
            for c in range(10):
                held = [loss[p[y[p] == c]] for p in part.train_idx if (y[p] == c).any()]
                assert all(a.max() <= b.min() for a, b in zip(held[:-1], held[1:])), c
            np.testing.assert_allclose(info["client_loss_mean"], [loss[p].mean() for p in part.train_idx])
    assert stds[1.0] < stds[0.0]
    assert stds[1.0] < stds[0.5] < stds[0.0] or stds[1.0] < 0.75 * stds[0.0]
    # the partition key covers the new keys (f changes the cache address), and off leaves it unchanged
    assert cfg_of(partition={"scheme": "dirichlet", "alpha": 0.5, "num_clients": 10, "difficulty_fraction": 1.0}
                  ).partition_key() != base.partition_key()
    assert "difficulty_fraction" not in base.partition_key()["partition"]
    # a whole run on a difficulty partition
    st = run_rounds(prepare(cfg_of({"ordering": "curr"}, partition={"scheme": "dirichlet", "alpha": 0.5, "num_clients": 10,
                                                                    "difficulty_fraction": 1.0, "difficulty_epochs": 2},
                                   rounds=1), tmp_path))
    assert np.isfinite(st.history[-1]["accuracy"])


# ---------------------------------------------------------------------- 10. resume


@pytest.mark.parametrize("cur", [
    {"ordering": "curr", "scoring": "s_L"},
    {"ordering": "random", "scoring": "s_LG_pred", "pacing_scope": "global", "pacing": "step"},
    {"clients": True, "ordering": "anti", "b": 0.5, "scoring": "s_L"},
], ids=["s_L", "global-clock", "client+data"])
def test_resume_is_bit_identical_with_a_curriculum(tmp_path, cur):
    full, resumed = assert_resume_bit_identical(cfg_of(cur, rounds=4), tmp_path, until=2)
    strip = lambda h: {k: v for k, v in h.items() if k != "round_time_s"}  # noqa: E731
    assert [strip(h) for h in resumed.history] == [strip(h) for h in full.history]
    if cur.get("scoring") == "s_L":
        assert "curriculum" in full.algo


def test_global_pacing_clock_runs_over_the_whole_run(tmp_path):
    cfg = cfg_of({"ordering": "curr", "pacing_scope": "global", "a": 0.8, "b": 0.2}, rounds=4, batch_size=16)
    prep = prepare(cfg, tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    pacings = []
    for r in range(4):
        state, spec = select_stage(prep, state, r)
        pacings.append(spec.pacing)
    # each round's clock starts at r/R of the run's budget (T = R · that round's local steps)
    for r, p in enumerate(pacings):
        assert p.total % 4 == 0 and p.offset == r * (p.total // 4)
    steps = pacings[0].total // 4
    # the first round sees only a small prefix; the last round (past a·T) sees everything
    n = 100
    last = pacings[3].total // 4
    assert pacings[0].size(0, n, steps) == 20 and pacings[3].size(last - 1, n, last) == n
    one = pacings[1].total // 4
    assert pacings[1].size(0, n, one) == pacing_size("linear", one, n, 4 * one, 0.8, 0.2) > 20
    # with the default round scope every round starts over
    prep = prepare(cfg_of({"ordering": "curr"}), tmp_path)
    _, spec = select_stage(prep, prep.algorithm.init_state(prep.ctx), 2)
    assert spec.pacing.offset == 0 and spec.pacing.total is None
