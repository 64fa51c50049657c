"""Methods that keep a personal model beside a FedAvg global one (flockfl/algorithms/ditto.py, apfl.py,
perfedavg.py, pfedme.py)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import assert_resume_bit_identical, last_json, tiny_config

from flockfl.errors import ConfigError

FULL = {"partition": {"scheme": "rotated", "num_clients": 8, "k": 2}, "train": {"clients_per_round": 8}}


def cfg_of(name: str, engine: str = "vectorized", **over):
    from flockfl.experiments import validate

    algo = {"name": name, **over.pop("algorithm", {})}
    train = {"engine": engine, "eval_finetune": "off", **over.pop("train", {})}
    return validate(tiny_config(algorithm=algo, train=train, **over))


def moreau(ctx, spec) -> dict:
    """pFedMe's round solve of ``spec``'s clients as its train shards run it: w_{i,R} and θ̃_i."""
    from flockfl.algorithms.pfedme import moreau_solver

    w, extra = moreau_solver(ctx.model, spec, ctx.data.train, ctx.data.task)
    return {"pfedme_w": w, "personal": extra["personal"]}


def run(cfg, tmp_path, until=None):
    from flockfl.rounds import prepare, run_rounds

    prep = prepare(cfg, tmp_path)
    return prep, run_rounds(prep, until=until)


def assert_same(a: dict, b: dict, exact: bool = True):
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- degenerate cases from the papers
@pytest.mark.parametrize("name,over", [("ditto", {"lam": 0.5}), ("apfl", {"alpha": 0.0, "adaptive": False})])
def test_global_model_is_fedavg(name, over, tmp_path):
    from flockfl.algorithms import ALGORITHMS
    from flockfl.algorithms.hyper import declared

    weighting = declared(ALGORITHMS[name])["weighting"].default  # FedAvg under the method's own client weights
    _, ref = run(cfg_of("fedavg", algorithm={"weighting": weighting}), tmp_path / "a")
    _, got = run(cfg_of(name, algorithm=over), tmp_path / "b")
    assert_same(ref.models, got.models)
    assert got.history[-1]["bytes_total"] == ref.history[-1]["bytes_total"]
    assert got.history[-1]["accuracy_global"] == ref.history[-1]["accuracy"]


def test_ditto_without_prox_is_local_training(tmp_path):
    """λ = 0 under full participation: every v_k equals the `local` algorithm's model."""
    _, loc = run(cfg_of("local", partition=FULL["partition"], train=FULL["train"]), tmp_path / "a")
    _, dit = run(cfg_of("ditto", algorithm={"lam": 0.0}, **FULL), tmp_path / "b")
    v = dit.algo["personal"].dense()
    for k in v:
        torch.testing.assert_close(v[k], loc.models[k], rtol=1e-6, atol=1e-7)
    assert dit.history[-1]["accuracy"] == pytest.approx(loc.history[-1]["accuracy"], abs=1e-6)


def test_ditto_large_lambda_pulls_personal_models_to_global(tmp_path):
    """‖v_k − w⁰‖ after one round shrinks as λ grows (λ → ∞: v_k = w)."""
    dist = {}
    for lam in (0.0, 5.0):
        prep, st = run(cfg_of("ditto", algorithm={"lam": lam}, train={"rounds": 1}), tmp_path / str(lam))
        w0 = prep.algorithm.init_state(prep.ctx).models
        cohort = np.flatnonzero(st.algo["personal"].written())
        v = st.algo["personal"].gather(cohort)
        dist[lam] = sum(float((v[k] - w0[k]).norm()) for k in v)
    assert dist[5.0] < 0.5 * dist[0.0], dist


def test_apfl_alpha_one_is_local_training(tmp_path):
    """Fixed α = 1: v̄ = v follows plain local SGD (the `local` algorithm)."""
    _, loc = run(cfg_of("local", partition=FULL["partition"], train=FULL["train"]), tmp_path / "a")
    _, ap = run(cfg_of("apfl", algorithm={"alpha": 1.0, "adaptive": False}, **FULL), tmp_path / "b")
    v = ap.algo["personal"].dense()
    for k in loc.models:
        torch.testing.assert_close(v[k], loc.models[k], rtol=1e-5, atol=1e-6)


def test_apfl_alpha_stays_in_unit_interval(tmp_path):
    _, st = run(cfg_of("apfl", algorithm={"alpha_lr": 50.0}), tmp_path)
    a = st.algo["personal"].dense()["__alpha__"]
    assert float(a.min()) >= 0 and float(a.max()) <= 1 and not torch.all(a == 0.5)


def test_perfedavg_without_adaptation_is_fedavg_on_the_second_batches(tmp_path):
    """α = 0 (spec §4): FO is plain SGD at lr β on the D' batches (every second batch)."""
    from torch.func import functional_call

    from flockfl.engine import TRAINERS
    from flockfl.engine.functional import per_sample_loss
    from flockfl.engine.schedule import client_batches
    from flockfl.rng import np_rng
    from flockfl.rounds import prepare

    prep = prepare(cfg_of("perfedavg", algorithm={"alpha": 0.0, "beta": 0.2}), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.init_state(ctx)
    clients = np.array([1, 4])
    spec = alg.local_spec(state, ctx, clients, 0)
    got = [TRAINERS[e](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, 0).params for e in ("reference", "vectorized")]
    for i, c in enumerate(clients):
        x, y = ctx.data.train.client(int(c))
        w = {k: v[0].clone().requires_grad_(True) for k, v in state.models.items()}
        batches = client_batches(len(x), spec, np_rng(ctx.seed, 0, int(c), "shuffle"), i)
        for b in batches[1:2 * (len(batches) // 2):2]:
            b = torch.as_tensor(b)
            loss = per_sample_loss(functional_call(ctx.model, w, (x[b],)), y[b], "classification").mean()
            g = torch.autograd.grad(loss, list(w.values()))
            w = {k: (v - 0.2 * gk).detach().requires_grad_(True) for (k, v), gk in zip(w.items(), g)}
        for params in got:
            for k in w:
                torch.testing.assert_close(params[k][i], w[k].detach(), rtol=1e-6, atol=1e-7)


def test_perfedavg_zero_adaptation_steps_is_the_global_accuracy(tmp_path):
    _, st = run(cfg_of("perfedavg", algorithm={"adapt_steps": 0}, train={"rounds": 1}), tmp_path)
    h = st.history[-1]
    assert h["accuracy"] == h["accuracy_global"] == h["accuracy_personal"]


def test_pfedme_beta_zero_freezes_w_and_theta_is_not_aliased(tmp_path):
    prep, st = run(cfg_of("pfedme", algorithm={"beta": 0.0}, train={"rounds": 2}), tmp_path)
    init = prep.algorithm.init_state(prep.ctx)
    assert_same(init.models, st.models)
    spec = prep.algorithm.local_spec(init, prep.ctx, np.array([0, 3]), 0)
    out = moreau(prep.ctx, spec)
    theta, w = out["personal"], out["pfedme_w"]
    assert all(not torch.equal(theta[k], w[k]) for k in w)  # θ̃_i is its own copy, not w_{i,R}
    assert not torch.equal(w["1.weight"], init.models["1.weight"].expand_as(w["1.weight"]))


# ---------------------------------------------------------------------- engine, state, resume
# Only where the two trainers run different code: Ditto's v-pass (each trainer's proximal SGD) and
# pFedMe's solve (the per-client loop vs the cohort at once). APFL's (v, α) loop and Per-FedAvg's
# meta-steps are one loop that both trainers call, so their agreement would prove nothing: their
# values are pinned by hand in tests/test_personal_rules.py (APFL's w there is the trainer's).
@pytest.mark.parametrize("name,over,train", [("ditto", {}, {"momentum": 0.5, "weight_decay": 0.01}),
                                             ("pfedme", {}, {"lr_schedule": "inverse", "lr_alpha": 0.5})])
def test_trainers_agree(name, over, train, tmp_path):
    a, b = (run(cfg_of(name, engine=e, algorithm=over, train={"rounds": 2, **train}), tmp_path / e)[1]
            for e in ("reference", "vectorized"))
    assert_same(a.models, b.models, exact=False)
    if "personal" in a.algo:
        assert_same(a.algo["personal"].dense(), b.algo["personal"].dense(), exact=False)
    assert a.history[-1]["accuracy"] == pytest.approx(b.history[-1]["accuracy"], abs=1e-6)


@pytest.mark.parametrize("name", ["ditto", "apfl", "perfedavg", "pfedme"])
def test_resume_is_bit_identical(name, tmp_path):
    assert_resume_bit_identical(cfg_of(name), tmp_path)


@pytest.mark.parametrize("name", ["ditto", "apfl", "pfedme"])
def test_only_the_cohort_rows_are_written(name, tmp_path):
    # pFedMe's default trains every client (train_all_clients, the paper's protocol): here the
    # cohort-only variant; tests/test_baseline_keys_pfedme_perfedavg.py covers the default
    algo = {"train_all_clients": False} if name == "pfedme" else {}
    prep, st = run(cfg_of(name, algorithm=algo, train={"rounds": 1}), tmp_path)
    cohort = prep.algorithm.select(prep.algorithm.init_state(prep.ctx), prep.ctx, 0)
    np.testing.assert_array_equal(np.flatnonzero(st.algo["personal"].written()), cohort)


@pytest.mark.parametrize("name", ["ditto", "apfl", "pfedme"])
def test_newcomers_start_from_the_global_model(name, tmp_path):
    prep, st = run(cfg_of(name, partition={"unseen_fraction": 0.25}, train={"rounds": 2}), tmp_path)
    h = st.history[-1]
    assert "unseen_accuracy" in h and "unseen_accuracy_untuned" in h
    unseen = prep.ctx.unseen
    assert len(unseen) and not st.algo["personal"].written(unseen).any()
    mine = prep.algorithm.own_models(st, prep.ctx, unseen, np.zeros(len(unseen), np.int64))
    for k, v in st.models.items():  # a client never seen gets the current global model
        torch.testing.assert_close(mine[k], v[:1].expand_as(mine[k]))


# ---------------------------------------------------------------------- a real check
def test_personal_beats_fedavg_on_label_skew(tmp_path):
    """Shards (2 labels per client), 20 clients, 5 rounds: personal accuracy ≫ FedAvg's global accuracy."""
    common = {"partition": {"scheme": "shards", "num_clients": 20}, "train": {"rounds": 5, "clients_per_round": 10}}
    acc = {}
    tuned = {"perfedavg": {"alpha": 0.1, "beta": 0.1}}  # the thesis's β = 1e-3 barely moves w in 5 rounds
    for name in ("fedavg", "ditto", "apfl", "perfedavg", "pfedme"):
        _, st = run(cfg_of(name, algorithm=tuned.get(name, {}), **common), tmp_path / name)
        acc[name] = st.history[-1]["accuracy"]
        if name != "fedavg":
            assert st.history[-1]["accuracy_personal"] == acc[name]
            acc[name + "_global"] = st.history[-1]["accuracy_global"]
    print(acc)
    for name in ("ditto", "apfl", "perfedavg", "pfedme"):
        assert acc[name] > acc["fedavg"] + 0.2, acc


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("name,key,bad", [
    ("ditto", "lam", -1), ("ditto", "personal_epochs", -1), ("ditto", "personal_epochs", 1.5), ("ditto", "schedule", "mixed"),
    ("apfl", "alpha", 1.5), ("apfl", "adaptive", "yes"), ("apfl", "alpha_lr", -0.1), ("apfl", "alpha_l2", -1),
    ("perfedavg", "variant", "so"), ("perfedavg", "alpha", -0.1), ("perfedavg", "beta", "x"),
    ("perfedavg", "delta", 0), ("perfedavg", "adapt_steps", -1),
    ("pfedme", "lam", 0), ("pfedme", "inner_steps", 0), ("pfedme", "personal_lr", -1), ("pfedme", "beta", -0.5),
])
def test_bad_values_are_one_line_config_errors(name, key, bad):
    from flockfl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        cfg_of(name, algorithm={key: bad})
    msg = str(err.value)
    assert "\n" not in msg and f"algorithm.{key}" in msg


@pytest.mark.parametrize("name,author,keys", [("ditto", "Li et al.", ("lam", "personal_epochs")),
                                              ("apfl", "Deng", ("alpha", "adaptive", "alpha_lr")),
                                              ("perfedavg", "Fallah", ("variant", "alpha", "beta", "delta")),
                                              ("pfedme", "Dinh", ("lam", "inner_steps", "personal_lr", "beta"))])
def test_cli_lists_the_method(name, author, keys, capsys):
    from flows.cli import main

    assert main(["list", name, "--json"]) == 0
    text = json.dumps(last_json(capsys.readouterr().out))
    assert author in text and all(f"algorithm.{k}" in text for k in keys)


def test_ditto_interleaved_equals_the_official_per_step_loop(tmp_path):
    """litian96/ditto: for each mini-batch, one v-step (∇F + λ(v − w^t)) then one w-step on the same
    batch. A hand-written loop for one client gives flockfl's v_k (schedule=interleaved, the default)."""
    from flockfl.engine.schedule import client_batches
    from flockfl.rng import np_rng

    lam, lr = 0.7, 0.1
    prep, st = run(cfg_of("ditto", algorithm={"lam": lam}, train={"rounds": 1, "lr": lr}), tmp_path)
    w0 = prep.algorithm.init_state(prep.ctx).models
    client = int(np.flatnonzero(st.algo["personal"].written())[0])
    x, y = prep.ctx.data.train.client(client)
    spec = prep.algorithm.personal_spec(st, prep.ctx, np.array([client]), w0, 1, "shuffle")
    model = prep.ctx.model
    names = [n for n, _ in model.named_parameters()]
    v = {k: w0[k][0].clone() for k in names}
    w = {k: w0[k][0].clone() for k in names}
    loss_fn = torch.nn.functional.cross_entropy
    for b in client_batches(len(y), spec, np_rng(prep.ctx.seed, 0, client, "shuffle")):
        for params, anchor in ((v, lam), (w, 0.0)):
            p = {k: t.clone().requires_grad_(True) for k, t in params.items()}
            loss = loss_fn(torch.func.functional_call(model, p, (x[b],)), y[b])
            grads = torch.autograd.grad(loss, list(p.values()))
            for (k, t), g in zip(params.items(), grads):
                params[k] = t - lr * (g + anchor * (t - w0[k][0]))
    got = st.algo["personal"].gather([client])
    for k in names:
        torch.testing.assert_close(got[k][0], v[k], rtol=1e-5, atol=1e-6)


def test_ditto_sequential_draws_its_own_batches_and_interleaved_refuses_other_epochs(tmp_path):
    _, inter = run(cfg_of("ditto"), tmp_path / "a")
    _, seq = run(cfg_of("ditto", algorithm={"schedule": "sequential"}), tmp_path / "b")
    assert_same(inter.models, seq.models)  # w is FedAvg either way
    a, b = inter.algo["personal"].dense(), seq.algo["personal"].dense()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # v follows another batch order
    with pytest.raises(ConfigError, match="algorithm.personal_epochs: 2 personal epochs cannot interleave"):
        cfg_of("ditto", algorithm={"personal_epochs": 2})
    cfg_of("ditto", algorithm={"personal_epochs": 2, "schedule": "sequential"})


def test_a_method_with_its_own_evaluation_model_never_takes_the_global_shortcut():
    """``chunk_metrics`` measures a never-trained client with the shared global pass only where
    ``own_models`` gives it exactly w: every PersonalModels subclass that computes its evaluation
    model itself declares so (``unwritten_rows_are_global = False``)."""
    from flockfl.algorithms import ALGORITHMS
    from flockfl.algorithms.personal import PersonalModels

    subs = {n: c for n, c in ALGORITHMS.items() if isinstance(c, type) and issubclass(c, PersonalModels)}
    assert {"ditto", "apfl", "perfedavg", "pfedme"} <= set(subs)
    for name, cls in subs.items():
        if cls.own_models is not PersonalModels.own_models:
            assert cls.unwritten_rows_are_global is False, name
    assert subs["ditto"].unwritten_rows_are_global and subs["pfedme"].unwritten_rows_are_global


@pytest.mark.parametrize("name", ["apfl", "perfedavg"])
def test_per_client_solvers_train_bn_on_batch_statistics_and_calibrate(name, tmp_path):
    """The per-client loops (APFL's v-pass, Per-FedAvg's meta-steps) train BatchNorm as the SGD
    trainers do: on batch statistics, and end with each model's own statistics (precise BN), so
    the trained models' running variances are no longer the init's ones (they were, when the
    loops ran the driver's evaluation-mode model), and the two trainers agree."""
    over = {"model": {"name": "cnn_bn"}, "train": {"rounds": 1}}
    algo = {"beta": 0.1} if name == "perfedavg" else {}
    a, b = (run(cfg_of(name, engine=e, algorithm=algo, **copy.deepcopy(over)), tmp_path / e)[1]
            for e in ("reference", "vectorized"))
    models = a.algo["personal"].dense() if name == "apfl" else a.models
    stats = [k for k in models if k.endswith("running_var")]
    assert stats and all(not torch.allclose(models[k], torch.ones_like(models[k])) for k in stats)
    assert_same(a.models, b.models, exact=False)


@pytest.mark.parametrize("name", ["ditto", "apfl"])
def test_the_personal_pass_runs_in_the_train_shards(name, tmp_path):
    """Ditto's v-pass and APFL's (v, α) pass run inside the round's train shards
    (LocalSpec.second, a typed SecondPass), so the executor distributes and retries them with the cohort: each
    shard's result carries its clients' new rows; shards of 2 give the rows of one shard, bit for
    bit; a client that fails every try is dropped with its row unwritten, the others' rows unchanged."""
    import dataclasses

    from flockfl.rounds import PLAIN, drive_round, prepare

    calls = []

    def train(prep, spec, engine, round):
        out = PLAIN.train(prep, spec, engine, round)
        calls.append((np.asarray(spec.clients).copy(), spec.second is not None, out[0]))
        return out

    prep = prepare(cfg_of(name, train={"rounds": 1, "shard_size": 2}), tmp_path / "two")
    new, _ = drive_round(prep, prep.algorithm.init_state(prep.ctx), 0, dataclasses.replace(PLAIN, train=train))
    (clients, has_pass, result), = calls
    assert has_pass and "personal" in result.meta
    np.testing.assert_array_equal(result.clients, clients)
    assert set(result.meta["personal"]) == set(new.algo["personal"].gather(clients[:1]))
    whole = prepare(cfg_of(name, train={"rounds": 1}), tmp_path / "all")
    ref, _ = drive_round(whole, whole.algorithm.init_state(whole.ctx), 0)
    assert_same(new.algo["personal"].gather(clients), ref.algo["personal"].gather(clients))
    assert_same(new.models, ref.models)

    bad = int(clients[0])
    failing = prepare(cfg_of(name, train={"rounds": 1, "shard_size": 2, "simulate_failures": [bad]}), tmp_path / "bad")
    got, _ = drive_round(failing, failing.algorithm.init_state(failing.ctx), 0)
    assert not got.algo["personal"].written(np.array([bad]))[0]
    rest = np.setdiff1d(clients, [bad])
    assert got.algo["personal"].written(rest).all()
    assert_same(got.algo["personal"].gather(rest), new.algo["personal"].gather(rest))
