"""The vectorised cohort trainer agrees with the per-client reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flockfl.experiments import validate
from flockfl.engine.data import ClientData, Split
from flockfl.engine import LocalSpec, choose_engine, train_cohort, train_reference
from flockfl.engine.functional import stack
from flockfl.engine.schedule import client_batches
from flockfl.rng import np_rng, torch_generator
from flockfl.rounds import PreparedRun, prepare_data, run_rounds
from models import build_model, init_params

from conftest import rel_err, tiny_config


def random_clients(sizes, shape=(1, 8, 8), classes=10, seed=0) -> ClientData:
    """Random inputs and labels, clients of unequal size."""
    g = torch.Generator().manual_seed(seed)
    n = int(sum(sizes))
    off = np.cumsum([0] + list(sizes)).astype(np.int64)
    tr = Split(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g), off)
    te = Split(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g), off)
    return ClientData(tr, te, np.repeat(np.arange(2), (len(sizes) + 1) // 2)[: len(sizes)], "classification", classes, shape)


@pytest.mark.parametrize("model_name,method", [("mclr", "dense"), ("mclr", "func"), ("mlp", "dense"), ("mlp", "func"),
                                               ("lenet5", "auto")])
@pytest.mark.parametrize("mode", ["epochs", "steps", "full_batch"])
def test_cohort_equals_reference(model_name, method, mode):
    sizes = [5, 17, 30, 1, 12, 23]
    data = random_clients(sizes)
    model = build_model(model_name, (1, 8, 8), 10, 32)
    clients = np.array([0, 1, 2, 3, 4, 5])
    init = stack([init_params(model, torch_generator(1, client=i, purpose="init")) for i in range(len(clients))])
    kw = {"epochs": {"epochs": 2, "batch_size": 7}, "steps": {"steps": 5, "batch_size": 4},
          "full_batch": {"steps": 3, "full_batch": True}}[mode]
    spec = LocalSpec(clients, init, 0.1, **kw)
    ref = train_reference(model, spec, data.train, data.task, seed=4, round=2)
    vec = train_cohort(model, spec, data.train, data.task, seed=4, round=2, method=method)
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_array_equal(vec.num_steps, ref.num_steps)
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)
    # and training did something: parameters moved
    assert rel_err(ref.params, init) > 1e-3


@pytest.mark.parametrize("model_name", ["mclr", "mlp"])
@pytest.mark.parametrize("steps,batch", [(2, 4), (10, 4), (3, 30)])
def test_low_rank_layers_from_a_shared_start_match_reference(model_name, steps, batch):
    """FedAvg-style broadcast init: low-rank factors, including the switch to dense when the
    rank passes its cap (10 steps × 4 > 16 for the 64→32 layer; batch 30 > cap at once)."""
    from flockfl.engine.dense import DenseCohort

    data = random_clients([5, 17, 30, 12, 23])
    model = build_model(model_name, (1, 8, 8), 10, 32)
    base = init_params(model, torch_generator(2, purpose="init"))
    init = {k: v.unsqueeze(0).expand(5, *v.shape) for k, v in base.items()}
    spec = LocalSpec(np.arange(5), init, 0.1, steps=steps, batch_size=batch)
    ref = train_reference(model, spec, data.train, data.task, seed=1, round=0)
    vec = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="dense")
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)
    cohort = DenseCohort(init, ["1"] if model_name == "mclr" else ["1", "3"], 0.1, batch)
    assert cohort.layers[0].lowrank == (batch <= 16)  # rank cap: min(64, out) // 2, in whole batches


@pytest.mark.parametrize("terms", ["prox", "correction", "momentum", "all"])
def test_gradient_terms_and_per_client_work_match_reference(terms):
    """FedProx / SCAFFOLD / FedNova-momentum terms, with unequal per-client step counts."""
    data = random_clients([9, 17, 30, 12, 23])
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(5, client=i, purpose="init")) for i in range(5)])
    g = torch.Generator().manual_seed(3)
    extra = {}
    if terms in ("prox", "all"):
        extra["prox_mu"] = 0.5
    if terms in ("correction", "all"):
        extra["correction"] = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in init.items()}
    if terms in ("momentum", "all"):
        extra["momentum"] = 0.9
    spec = LocalSpec(np.arange(5), init, 0.05, batch_size=4, client_steps=np.array([1, 3, 6, 0, 4]), **extra)
    ref = train_reference(model, spec, data.train, data.task, seed=0, round=1)
    vec = train_cohort(model, spec, data.train, data.task, seed=0, round=1)
    np.testing.assert_array_equal(ref.num_steps, [1, 3, 6, 0, 4])
    np.testing.assert_array_equal(vec.num_steps, ref.num_steps)
    assert rel_err(vec.params, ref.params) < 1e-5
    for k in init:  # the client with no step stays exactly where it started
        torch.testing.assert_close(vec.params[k][3], init[k][3], rtol=0, atol=0)


def test_prox_term_pulls_towards_the_anchor():
    data = random_clients([40] * 3)
    model = build_model("mclr", (1, 8, 8), 10)
    init = stack([init_params(model, torch_generator(0, purpose="init"))] * 3)
    drift = {}
    for mu in (0.0, 100.0):
        res = train_cohort(model, LocalSpec(np.arange(3), init, 0.005, steps=20, batch_size=8, prox_mu=mu),
                           data.train, data.task, 0, 0)
        drift[mu] = rel_err(res.params, init)
    assert drift[100.0] < 0.2 * drift[0.0]  # μ → ∞ returns w_t


def test_dense_path_regression_matches_reference():
    g = torch.Generator().manual_seed(0)
    sizes = [7, 20, 13]
    off = np.cumsum([0] + sizes)
    data = Split(torch.randn(40, 6, generator=g), torch.randn(40, generator=g), off)
    model = build_model("linear", (6,), 1)
    init = {"1.weight": torch.randn(3, 1, 6, generator=g)}
    spec = LocalSpec(np.arange(3), init, 0.05, epochs=3, batch_size=4)
    ref = train_reference(model, spec, data, "regression", 0, 0)
    vec = train_cohort(model, spec, data, "regression", 0, 0, method="dense")
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)


def test_dense_path_only_for_linear_relu_stacks():
    from flockfl.engine.dense import dense_layers

    assert dense_layers(build_model("mlp", (1, 8, 8), 10)) == ["1", "3"]
    assert dense_layers(build_model("mclr", (1, 8, 8), 10)) == ["1"]
    assert dense_layers(build_model("lenet5", (1, 8, 8), 10)) is None
    assert dense_layers(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))) is None  # no ReLU between


def test_unequal_sizes_take_their_own_number_of_steps():
    data = random_clients([3, 10, 25])
    model = build_model("mclr", (1, 8, 8), 10)
    init = stack([init_params(model, torch_generator(0, client=i, purpose="init")) for i in range(3)])
    res = train_cohort(model, LocalSpec(np.arange(3), init, 0.1, epochs=2, batch_size=5), data.train, data.task, 0, 0)
    np.testing.assert_array_equal(res.num_steps, [2, 4, 10])  # E·⌈n_i/B⌉


def test_schedule_is_a_pure_function_of_its_key():
    spec = LocalSpec(np.arange(1), {}, 0.1, epochs=3, batch_size=4)
    a = client_batches(10, spec, np_rng(7, 3, 2, "shuffle"))
    b = client_batches(10, spec, np_rng(7, 3, 2, "shuffle"))
    c = client_batches(10, spec, np_rng(7, 4, 2, "shuffle"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert sorted(np.concatenate(a[:3]).tolist()) == list(range(10))  # an epoch sees each sample once


def test_choose_engine_returns_a_trainer_and_timings():
    data = random_clients([20] * 8)
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(0, client=i, purpose="init")) for i in range(8)])
    choice, t = choose_engine(model, LocalSpec(np.arange(8), init, 0.1, epochs=1, batch_size=5), data.train, data.task, 0)
    assert choice in ("reference", "vectorized") and t["reference_s_est"] > 0 and t["vectorized_s_est"] > 0


def test_the_probe_verdict_is_kept_per_model_shapes_and_threads(tmp_path, monkeypatch):
    """The second run of the same setting reads the verdict; another batch size, model or
    thread count measures anew; a damaged cache is measured over; ``off`` keeps nothing."""
    from flockfl.engine import probe

    calls = []

    def fake(model, spec, data, task, seed):
        calls.append(spec.batch_size)
        return "reference", {"reference_s_est": 1.0, "vectorized_s_est": 2.0, "vectorized_step_s": 0.1}

    monkeypatch.setattr(probe, "choose_engine", fake)
    cache = tmp_path / "probe.json"
    monkeypatch.setenv(probe.CACHE_ENV, str(cache))
    data = random_clients([20] * 8)
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(0, client=i, purpose="init")) for i in range(8)])
    spec = LocalSpec(np.arange(8), init, 0.1, epochs=1, batch_size=5)
    assert probe.cached_choice(model, spec, data.train, data.task, 0) == ("reference", fake(0, spec, 0, 0, 0)[1], False)
    calls.clear()
    assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is True and calls == []
    assert probe.cached_choice(model, LocalSpec(np.arange(8), init, 0.1, epochs=1, batch_size=4), data.train,
                               data.task, 0)[2] is False
    other = build_model("mlp", (1, 8, 8), 10, 32)
    init2 = stack([init_params(other, torch_generator(0, client=i, purpose="init")) for i in range(8)])
    assert probe.cached_choice(other, LocalSpec(np.arange(8), init2, 0.1, epochs=1, batch_size=5), data.train,
                               data.task, 0)[2] is False
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is False
    finally:
        torch.set_num_threads(threads)
    cache.write_text("{not json")
    assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is False
    assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is True
    monkeypatch.setenv(probe.CACHE_ENV, "off")
    calls.clear()
    assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is False
    assert probe.cached_choice(model, spec, data.train, data.task, 0)[2] is False and len(calls) == 2


def test_choose_engine_scales_only_the_per_step_cost(monkeypatch):
    """The vectorised estimate is its fixed cost plus steps × its cost per step: a cohort trainer
    with 1 s of fixed work (BN calibration, say) and 10 ms a step is estimated at 1.2 s for 20
    steps, not at 20 × (1 s + 2 steps)/2 steps, and so wins against a 4 s reference."""
    from flockfl.engine import probe

    clock = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])

    def cohort(model, spec, *args, **kw):
        clock[0] += 1.0 + 0.01 * spec.steps

    def reference(model, spec, *args, **kw):
        clock[0] += 0.5 * len(spec.clients)

    monkeypatch.setattr(probe, "train_cohort", cohort)
    monkeypatch.setattr(probe, "train_reference", reference)
    data = random_clients([20] * 8)
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(0, client=i, purpose="init")) for i in range(8)])
    choice, t = choose_engine(model, LocalSpec(np.arange(8), init, 0.1, epochs=5, batch_size=5), data.train, data.task, 0)
    assert t["vectorized_s_est"] == pytest.approx(1.0 + 0.01 * 20)
    assert t["reference_s_est"] == pytest.approx(4.0)
    assert choice == "vectorized"


def _prepared(cfg, data) -> PreparedRun:
    return prepare_data(cfg, data)


@pytest.mark.parametrize("algo", [
    {"name": "fedavg"},
    {"name": "fedsgd"},
    {"name": "ifca", "k": 3, "option": "model"},
    {"name": "ifca", "k": 3, "option": "gradient"},
    {"name": "fedprox", "mu": 0.1},
    {"name": "fednova", "momentum": 0.5},
    {"name": "fednova", "mu": 0.2},
    {"name": "scaffold", "option": "II"},
    {"name": "scaffold", "option": "I"},
    {"name": "fedadam"},
    {"name": "fedadagrad"},
    {"name": "fedyogi"},
    {"name": "fedavgm"},
    {"name": "fedsplit", "s": 0.5},
    {"name": "fedeff"},
    {"name": "ccfl", "server_opt": "ams", "availability": 0.7, "max_delay": 1},
])
def test_whole_rounds_agree_between_engines(algo):
    data = random_clients([9, 14, 21, 6, 30, 11, 8, 19])
    states = {}
    work = {"local_steps": 4} if algo["name"] == "ccfl" else {"local_work": "uniform_random", "local_epochs": 2}
    for engine in ("reference", "vectorized"):
        cfg = validate(tiny_config(algorithm=algo, partition={"num_clients": 8},
                                   train={"engine": engine, "rounds": 3, "clients_per_round": 5, "batch_size": 4, **work}))
        states[engine] = run_rounds(_prepared(cfg, data))
    ref, vec = states["reference"], states["vectorized"]
    assert rel_err(vec.models, ref.models) < 1e-5
    np.testing.assert_array_equal(vec.assignments, ref.assignments)


def test_the_trainer_is_set_once_on_the_context_and_kept_by_a_resumed_run(tmp_path):
    """``ctx.trainer`` (every pass outside a round: fine-tuning, newcomers, FedRep's head
    epochs, pre-training) is the engine the first round chose; a resumed run takes it from the
    state before its first pass, whatever a probe would say now."""
    from conftest import tiny_config

    from flockfl.engine import TRAINERS
    from flockfl.experiments import validate
    from flockfl.rounds import drive_round, prepare, run_rounds

    cfg = validate(tiny_config(train={"engine": "auto", "rounds": 2}))
    prep = prepare(cfg, tmp_path)
    assert prep.ctx.engine is None and prep.ctx.trainer is TRAINERS["vectorized"]  # before any round chose
    state = run_rounds(prep, until=1)
    assert prep.ctx.engine == state.driver.engine and prep.ctx.trainer is TRAINERS[state.driver.engine]
    other = "reference" if state.driver.engine == "vectorized" else "vectorized"
    fresh = prepare(cfg, tmp_path)
    import dataclasses

    drive_round(fresh, state.replace(driver=dataclasses.replace(state.driver, engine=other)), 1)
    assert fresh.ctx.engine == other and fresh.ctx.trainer is TRAINERS[other]


def test_a_pass_outside_the_round_is_sharded_and_retried_like_a_round(tmp_path, monkeypatch):
    """``train_pass``: shards of ``train.shard_size`` clients give the same models as one batch;
    a shard that raises once is tried again (``train.max_retries``), one that keeps raising ends
    the pass with its error."""
    from flockfl import context
    from flockfl.client import pass_spec, train_pass
    from flockfl.rounds import prepare

    prep = prepare(validate(tiny_config(train={"shard_size": 3, "max_retries": 1})), tmp_path)
    ctx, t = prep.ctx, prep.cfg.train
    state = prep.algorithm.init_state(ctx)
    clients = np.arange(8)
    init = {k: v[:1].expand(8, *v.shape[1:]) for k, v in state.models.items()}
    spec = pass_spec(t, clients, init, 1, stream="finetune")
    whole = ctx.trainer(ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, 0)
    sizes, fails = [], {"left": 1}
    real = context.TRAINERS["vectorized"]

    def flaky(model, shard, *a):
        sizes.append(len(shard.clients))
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("transient")
        return real(model, shard, *a)

    monkeypatch.setitem(context.TRAINERS, "vectorized", flaky)
    out = train_pass(ctx, spec, 0)
    assert sizes == [3, 3, 3, 2]  # the first shard tried twice
    np.testing.assert_array_equal(out.clients, clients)
    for k in whole.params:
        torch.testing.assert_close(out.params[k], whole.params[k], rtol=0, atol=1e-6)
    fails["left"] = 2
    with pytest.raises(RuntimeError, match="transient"):
        train_pass(ctx, spec, 0)
