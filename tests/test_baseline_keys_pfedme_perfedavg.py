"""The keys of spec §4 (Per-FedAvg) and §10 (pFedMe) that issue 20 adds (flockfl/algorithms/pfedme.py,
perfedavg.py): pFedMe's ``local_rounds`` (R), ``inner_l2`` (μ) and ``train_all_clients``, and
Per-FedAvg's ``eval_model`` (adapt, finetune, last_local)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import yaml

from conftest import assert_resume_bit_identical, run_flock, tiny_config

from flockfl.algorithms.pfedme import moreau_solver
from flockfl.errors import ConfigError
from test_personal_models import cfg_of, moreau, run  # the personal baselines' config, run and pFedMe solve helpers

# the digests of the default pfedme and perfedavg runs of the corpus before these keys existed
# (tests/digest_corpus.py: pfedme, perfedavg variant=hf; both trainers): pfedme with
# train_all_clients=false, inner_l2=0, local_rounds=null and Per-FedAvg with eval_model=adapt must keep them
# the digests of before the keys, as this machine's arithmetic ends them (tests/digest_corpus.py)
PFEDME_BEFORE = "pfedme/{engine}@before_train_all_clients"


def assert_same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------- bad values: one line, exit 2
# each case is a real `flockfl` process (5-30 s in the parallel suite): the fast tier runs the first,
# the full suite all of them
@pytest.mark.parametrize("name,key,bad", [
    ("pfedme", "local_rounds", 0), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("pfedme", "local_rounds", 2.5), ("pfedme", "inner_l2", -0.001),
        ("pfedme", "train_all_clients", "yes"), ("perfedavg", "eval_model", "personal_ft"))),
])
def test_a_bad_value_of_a_new_key_exits_2_with_one_line(workdir, name, key, bad):
    raw = tiny_config(name="bad-key", algorithm={"name": name, key: bad})
    (workdir / "bad.yaml").write_text(yaml.safe_dump(raw))
    res = run_flock(["run", "bad.yaml"], workdir, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"flockfl: error: config error: algorithm.{key}: {bad!r} is not allowed for {name}")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (workdir / "runs").exists()  # nothing ran


@pytest.mark.parametrize("name,algo,train,needle", [
    ("pfedme", {"local_rounds": 4}, {"local_steps": 3}, "algorithm.local_rounds: pfedme takes its R local rounds"),
    ("pfedme", {"local_rounds": 4}, {"local_work": "uniform_random"}, "set train.local_work=constant"),
    ("perfedavg", {"eval_model": "finetune", "adapt_steps": 3}, {}, "algorithm.adapt_steps: 3 adaptation steps only "
                                                                     "apply to eval_model=adapt"),
])
def test_keys_that_contradict_each_other_are_one_line_errors(name, algo, train, needle):
    with pytest.raises(ConfigError) as err:
        cfg_of(name, algorithm=algo, train=train)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and ("drop" in msg or "set " in msg)


def test_the_new_keys_are_listed_with_their_sources(capsys):
    from flows.cli import main

    from conftest import last_json

    for name, keys in (("pfedme", ("local_rounds", "inner_l2", "train_all_clients")), ("perfedavg", ("eval_model",))):
        assert main(["list", name, "--json"]) == 0
        rows = {r["key"]: r for r in last_json(capsys.readouterr().out)["hyperparameters"]}
        for k in keys:
            assert rows[f"algorithm.{k}"]["source"] in ("paper", "library") and rows[f"algorithm.{k}"]["source_note"]
    from flockfl.algorithms import ALGORITHMS
    from flockfl.algorithms.hyper import declared

    d = declared(ALGORITHMS["pfedme"])
    assert (d["local_rounds"].default, d["inner_l2"].default, d["train_all_clients"].default) == (None, 0.0, True)
    assert declared(ALGORITHMS["perfedavg"])["eval_model"].default == "adapt"


# ---------------------------------------------------------------------- defaults: today's behaviour bit for bit
@pytest.mark.parametrize("engine", ["reference"])
def test_pfedme_cohort_only_with_mu_zero_and_every_batch_is_the_digest_of_before(engine, tmp_path):
    """train_all_clients=false, inner_l2=0 (set explicitly) and local_rounds=null reproduce the
    pre-issue pfedme digest (the only default that changed is train_all_clients). The
    vectorised trainer had the same bits while it ran the per-client solve too; it now solves
    the cohort at once and agrees to float rounding (test_train_all_clients_reference_...)."""
    import digest_corpus as corpus
    from flockfl.config import deep_merge

    over = {"algorithm": {"name": "pfedme", "train_all_clients": False, "inner_l2": 0.0, "local_rounds": None},
            "train": {"engine": engine}}
    assert corpus.run_case(f"pfedme/{engine}", tiny_config(**deep_merge(corpus.ALGORITHMS["pfedme"], over)),
                           tmp_path) == corpus.recorded()[PFEDME_BEFORE.format(engine=engine)]


def test_perfedavg_eval_model_adapt_is_the_digest_of_before(tmp_path):
    import digest_corpus as corpus
    from flockfl.config import deep_merge

    raw = tiny_config(**deep_merge(corpus.ALGORITHMS["perfedavg"], {"algorithm": {"eval_model": "adapt"}}))
    assert corpus.run_case("perfedavg/vectorized", raw, tmp_path) == corpus.recorded()["perfedavg/vectorized"]


# ---------------------------------------------------------------------- pFedMe: R, μ
def test_local_rounds_takes_exactly_R_inner_solves_of_one_batch_each(tmp_path):
    """The official loop (CharlieDinh/pFedMe userpFedMe.py + pFedMeOptimizer), written here with an
    nn.Module and autograd: R times, the next batch of the client's order (cycling over epochs),
    K steps p ← p − η_p(∇f + λ(p − w) + μp) on it, then w ← w − λη(w − p)."""
    from flockfl.rng import np_rng
    from flockfl.rounds import prepare

    R, K, lam, p_lr, lr, mu, b = 13, 3, 15.0, 0.05, 0.01, 1e-3, 16
    cfg = cfg_of("pfedme", algorithm={"local_rounds": R, "inner_steps": K, "lam": lam, "personal_lr": p_lr,
                                      "inner_l2": mu, "train_all_clients": False}, train={"lr": lr, "batch_size": b})
    prep = prepare(cfg, tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.init_state(ctx)
    clients = np.array([2, 7])
    spec = alg.local_spec(state, ctx, clients, 0)
    out = moreau(ctx, spec)
    for i, c in enumerate(clients):
        x, y = ctx.data.train.client(int(c))
        n = len(y)
        assert R > -(-n // b)  # more rounds than one epoch has batches: the order cycles into a second epoch
        rng, order = np_rng(ctx.seed, 0, int(c), "shuffle"), []
        while len(order) < R:
            perm = rng.permutation(n)
            order += [perm[a:a + b] for a in range(0, n, b)]
        net = copy.deepcopy(ctx.model)
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.copy_(state.models[k][0])
        local = {k: p.detach().clone() for k, p in net.named_parameters()}
        for batch in order[:R]:
            xb, yb = x[torch.as_tensor(batch)], y[torch.as_tensor(batch)]
            for _ in range(K):
                net.zero_grad()
                torch.nn.functional.cross_entropy(net(xb), yb).backward()
                with torch.no_grad():
                    for k, p in net.named_parameters():
                        p.sub_(p_lr * (p.grad + lam * (p - local[k]) + mu * p))
            with torch.no_grad():
                for k, p in net.named_parameters():
                    local[k] = local[k] - lam * lr * (local[k] - p)
        for k, p in net.named_parameters():
            torch.testing.assert_close(out["personal"][k][i], p.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["pfedme_w"][k][i], local[k], rtol=1e-5, atol=1e-6)
    # null: every batch of the epoch, i.e. fewer rounds than R here: another result
    spec0 = alg.__class__(cfg_of("pfedme", algorithm={"inner_steps": K, "lam": lam, "personal_lr": p_lr, "inner_l2": mu},
                                 train={"lr": lr, "batch_size": b})).local_spec(state, ctx, clients, 0)
    assert not torch.equal(moreau(ctx, spec0)["pfedme_w"]["1.weight"], out["pfedme_w"]["1.weight"])


def test_inner_l2_zero_is_the_paper_and_positive_moves_theta(tmp_path):
    from flockfl.rounds import prepare

    prep = prepare(cfg_of("pfedme"), tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    clients = np.array([0, 5])
    theta = {}
    for mu in (0.0, 0.5):
        alg = prep.algorithm.__class__(cfg_of("pfedme", algorithm={"inner_l2": mu}))
        theta[mu] = moreau(prep.ctx, alg.local_spec(state, prep.ctx, clients, 0))["personal"]
    base = moreau(prep.ctx, prep.algorithm.local_spec(state, prep.ctx, clients, 0))["personal"]  # the default (μ = 0)
    assert_same(theta[0.0], base)
    # μθ shrinks θ̃ towards 0
    assert sum(float(v.norm()) for v in theta[0.5].values()) < sum(float(v.norm()) for v in theta[0.0].values())


# ---------------------------------------------------------------------- pFedMe: every client trains
def test_train_all_clients_sets_every_theta_but_aggregates_only_the_cohort(tmp_path):
    over = {"partition": {"unseen_fraction": 0.25}, "train": {"rounds": 1}}
    # the reference trainer: its solve is the per-client loop that ``moreau`` runs below, bit for bit
    prep, every = run(cfg_of("pfedme", engine="reference", **copy.deepcopy(over)), tmp_path / "all")
    _, cohort_only = run(cfg_of("pfedme", engine="reference", algorithm={"train_all_clients": False},
                                **copy.deepcopy(over)), tmp_path / "cohort")
    alg, ctx = prep.algorithm, prep.ctx
    init = alg.init_state(ctx)
    cohort = alg.select(init, ctx, 0)
    seen, others = np.sort(ctx.seen), np.setdiff1d(ctx.seen, cohort)
    assert len(others) and len(ctx.unseen)
    assert_same(every.models, cohort_only.models)  # the global w: the cohort's w_{i,R} only
    np.testing.assert_array_equal(np.flatnonzero(every.algo["personal"].written()), seen)  # no newcomer trains
    np.testing.assert_array_equal(np.flatnonzero(cohort_only.algo["personal"].written()), cohort)
    assert_same(every.algo["personal"].gather(cohort), cohort_only.algo["personal"].gather(cohort))
    # an unsampled client's θ̃: its own local rounds from the w_t it was sent
    got = every.algo["personal"].gather(others)
    assert_same(got, moreau(ctx, alg.local_spec(init, ctx, others, 0))["personal"])
    for k, v in got.items():
        assert not torch.equal(v, init.models[k].expand_as(v)) and not torch.equal(v, every.models[k].expand_as(v))
    per = sum(v[0].numel() * v.element_size() for v in init.models.values())
    h, h0 = every.history[-1], cohort_only.history[-1]
    assert (h["bytes_down"], h["bytes_up"]) == (len(seen) * per, len(cohort) * per)
    assert (h0["bytes_down"], h0["bytes_up"]) == (len(cohort) * per, len(cohort) * per)
    assert h["accuracy_global"] == h0["accuracy_global"]


def test_unsampled_clients_train_through_the_train_stage_as_companions(tmp_path):
    """The unsampled clients are trained by the round's train stage (the one the Dask executor
    distributes), after the cohort, a chunk of ``train.shard_size`` at a time: the first train
    call is the cohort, the next ones together are every federating client outside it, all with
    the Moreau solver; a failing companion keeps its old θ̃ and the run warns once."""
    import dataclasses

    from flockfl.rounds import PLAIN, drive_round, prepare

    cfg = cfg_of("pfedme", train={"rounds": 1, "shard_size": 2, "simulate_failures": []})
    prep = prepare(cfg, tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    calls = []

    def train(prep, spec, engine, round):
        calls.append((np.asarray(spec.clients).copy(), spec.solver))
        return PLAIN.train(prep, spec, engine, round)

    state = alg.init_state(ctx)
    new, _ = drive_round(prep, state, 0, dataclasses.replace(PLAIN, train=train))
    cohort = alg.select(state, ctx, 0)
    others = np.setdiff1d(ctx.seen, cohort)
    assert all(solver is moreau_solver for _, solver in calls)
    np.testing.assert_array_equal(calls[0][0], cohort)
    assert [len(c) for c, _ in calls[1:]] == [2] * (len(others) // 2) + [1] * (len(others) % 2)  # chunks of 2
    np.testing.assert_array_equal(np.concatenate([c for c, _ in calls[1:]]), others)
    assert new.algo["personal"].written(np.asarray(ctx.seen)).all()

    # a companion that fails every try: dropped from the companions, warned, its row unwritten
    bad = int(others[0])
    prep_bad = prepare(cfg_of("pfedme", train={"rounds": 1, "shard_size": 2, "simulate_failures": [bad]}), tmp_path)
    with pytest.warns(RuntimeWarning, match=rf"companion clients \[{bad}\] failed to train"):
        new_bad, _ = drive_round(prep_bad, prep_bad.algorithm.init_state(prep_bad.ctx), 0)
    assert not new_bad.algo["personal"].written(np.array([bad]))[0]
    rest = np.setdiff1d(others, [bad])
    assert_same(new_bad.algo["personal"].gather(rest), new.algo["personal"].gather(rest))


@pytest.mark.parametrize("engine", ["reference", "vectorized"])
def test_train_all_clients_is_the_same_in_any_chunk_size(engine, tmp_path):
    """Unsampled clients processed 2 at a time (train.shard_size) or all at once: the same w and
    the same θ̃ of every client, bit for bit, under either trainer."""
    a = run(cfg_of("pfedme", engine=engine, train={"rounds": 2, "shard_size": 2}), tmp_path / "two")[1]
    b = run(cfg_of("pfedme", engine=engine, train={"rounds": 2}), tmp_path / "all")[1]
    assert a.algo["personal"].written().all()
    assert_same(a.algo["personal"].dense(), b.algo["personal"].dense())
    assert a.digest() == b.digest()


@pytest.mark.parametrize("model", ["mlp", "cnn_bn"])
def test_the_cohort_solve_equals_the_per_client_loop(model, tmp_path):
    """The vectorised trainer's Moreau solve (all clients at once, moreau_pass_stacked) and the
    reference's per-client loop: the same w and θ̃ of every client to float rounding, BatchNorm
    statistics included (batch statistics while training, each model's own after it: precise BN)."""
    over = {"model": {"name": model}, "train": {"rounds": 1 if model == "cnn_bn" else 2}}
    a = run(cfg_of("pfedme", engine="reference", **copy.deepcopy(over)), tmp_path / "ref")[1]
    b = run(cfg_of("pfedme", engine="vectorized", **copy.deepcopy(over)), tmp_path / "vec")[1]
    for x, y in ((a.models, b.models), (a.algo["personal"].dense(), b.algo["personal"].dense())):
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=1e-4, atol=1e-5)
    assert a.history[-1]["accuracy"] == pytest.approx(b.history[-1]["accuracy"], abs=1e-3)
    if model == "cnn_bn":  # θ̃'s statistics are its own, not the init's (0, 1)
        theta = a.algo["personal"].dense()
        stats = [k for k in theta if k.endswith("running_var")]
        assert stats and all(not torch.allclose(theta[k], torch.ones_like(theta[k])) for k in stats)


# ---------------------------------------------------------------------- Per-FedAvg: the evaluation model
def test_perfedavg_last_local_is_each_clients_model_after_its_last_local_training(tmp_path):
    """Two rounds of 6 of 12 clients: a client's evaluation model is its w^i of the last round it
    trained in (the meta-steps from that round's w), the global w if it never trained."""
    from flockfl.algorithms.perfedavg import maml_solver
    from flockfl.eval_protocol import protocol
    from flockfl.evaluation import measure_own

    cfg = cfg_of("perfedavg", algorithm={"eval_model": "last_local", "alpha": 0.05, "beta": 0.1}, train={"rounds": 2})
    prep, st = run(cfg, tmp_path / "full")
    _, st1 = run(cfg, tmp_path / "one", until=1)
    alg, ctx = prep.algorithm, prep.ctx
    seen = np.asarray(ctx.seen, np.int64)
    expected = {k: v[0].expand(len(seen), *v.shape[1:]).clone() for k, v in st.models.items()}
    trained = set()
    for r, before in ((0, alg.init_state(ctx)), (1, st1)):
        cohort = alg.select(before, ctx, r)
        local = maml_solver(ctx.model, alg.local_spec(before, ctx, cohort, r), ctx.data.train, ctx.data.task)
        for i, c in enumerate(cohort):
            for k in expected:
                expected[k][int(np.flatnonzero(seen == c)[0])] = local[k][i]
        trained |= set(int(c) for c in cohort)
    assert 0 < len(trained) < len(seen)  # some clients fall back to w
    np.testing.assert_array_equal(np.flatnonzero(st.algo["personal"].written()), sorted(trained))
    want = measure_own(ctx, expected, seen)
    got = alg.evaluate(st, ctx)
    np.testing.assert_array_equal(got["_client_accuracy"], want[protocol(ctx).test_set][1])
    assert st.history[-1]["accuracy"] == got["accuracy"] != got["accuracy_global"]


def test_perfedavg_finetune_is_one_epoch_of_sgd_at_alpha_and_alpha_zero_is_the_global_model(tmp_path):
    from flockfl.engine.schedule import client_batches
    from flockfl.client import pass_spec
    from flockfl.rng import np_rng

    _, flat = run(cfg_of("perfedavg", algorithm={"eval_model": "finetune", "alpha": 0.0}, train={"rounds": 1}),
                  tmp_path / "zero")
    h = flat.history[-1]
    assert h["accuracy"] == h["accuracy_global"] == h["accuracy_personal"]

    alpha = 0.05
    prep, st = run(cfg_of("perfedavg", algorithm={"eval_model": "finetune", "alpha": alpha}, train={"rounds": 1}),
                   tmp_path / "tuned")
    alg, ctx = prep.algorithm, prep.ctx
    client = np.array([3])
    got = alg.own_models(st, ctx, client, np.zeros(1, np.int64))
    # one epoch of plain SGD at α, written out: the batches of the (seed, round, client, "perfedavg_finetune") stream
    x, y = ctx.data.train.client(3)
    w = {k: v[0].clone() for k, v in st.models.items()}
    spec = pass_spec(ctx.cfg.train, client, {k: v[None] for k, v in w.items()}, 1, stream="perfedavg_finetune")
    batches = client_batches(len(y), spec, np_rng(ctx.seed, st.round, 3, "perfedavg_finetune"))
    assert len(batches) == -(-len(y) // ctx.cfg.train.batch_size)  # one epoch
    for b in batches:
        p = {k: t.clone().requires_grad_(True) for k, t in w.items()}
        loss = torch.nn.functional.cross_entropy(torch.func.functional_call(ctx.model, p, (x[b],)), y[b])
        grads = torch.autograd.grad(loss, list(p.values()))
        w = {k: (t - alpha * g).detach() for (k, t), g in zip(p.items(), grads)}
    for k in w:
        torch.testing.assert_close(got[k][0], w[k], rtol=1e-5, atol=1e-6)
    assert st.history[-1]["accuracy"] != st.history[-1]["accuracy_global"]
    assert "personal" not in st.algo  # nothing kept per client


def test_perfedavg_last_local_resumes_bit_for_bit(tmp_path):
    assert_resume_bit_identical(cfg_of("perfedavg", algorithm={"eval_model": "last_local"}), tmp_path)
