"""How many local steps each model of a personalised method takes, and at which rates (issue 35).

The instrument: two scalar "counters" added to the run's MLP, one inside its first Linear (the
body) and one inside its last Linear (the head), both starting at 1 and used by no forward pass.
A counter's gradient is 0, so a step moves it only by the optimiser's own terms: with weight
decay ω at rate η_s, c ← (1 − η_s·ω)c per step (Ditto's v adds λ(c − c_anchor), Per-FedAvg's
momentum buffer, pFedMe's inner μθ); every expectation below is that recurrence run for the
number of steps the configuration asks for, so a model that takes one step too many or too few,
or the wrong rate, fails. The reference trainer runs them (the cohort trainer's stacked step
wants every parameter in the graph); both trainers follow the same schedule (tests elsewhere).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config

from flockfl.errors import ConfigError

ETA, OMEGA, B = 0.1, 0.1, 16  # train.lr, train.weight_decay, train.batch_size (tiny_config's)
BODY, HEAD = "1.counter", "3.counter"  # the MLP's first and last Linear: Flatten, Linear, ReLU, Linear


def cfg_of(name: str, algorithm=None, train=None, **over):
    from flockfl.experiments import validate

    train = {"engine": "reference", "eval_finetune": "off", "rounds": 1, "lr": ETA, "weight_decay": OMEGA,
             **(train or {})}
    return validate(tiny_config(algorithm={"name": name, **(algorithm or {})}, train=train, **over))


def counted_run(cfg, tmp_path, monkeypatch):
    """``cfg`` run with the two counters in its model (initialised to 1)."""
    import flockfl.algorithms.base as base
    from flockfl.rounds import prepare, run_rounds

    fresh = base.init_params

    def ones(model, generator):
        out = fresh(model, generator)
        return {k: torch.ones_like(v) if k.endswith("counter") else v for k, v in out.items()}

    monkeypatch.setattr(base, "init_params", ones)
    prep = prepare(cfg, tmp_path)
    linears = [m for m in prep.ctx.model.modules() if isinstance(m, nn.Linear)]
    for layer in (linears[0], linears[-1]):
        layer.register_parameter("counter", nn.Parameter(torch.ones(3)))
    return prep, run_rounds(prep)


def rates(t, steps: int) -> list[float]:
    """train.lr on its schedule at local steps 0..steps−1 of round 0, written out."""
    if t.lr_schedule == "inverse":
        return [t.lr * (1 + t.lr_alpha * i) ** -t.lr_b for i in range(steps)]
    return [t.lr] * steps


def decayed(t, steps: int, c: float = 1.0) -> float:
    """A counter after ``steps`` plain SGD steps with weight decay: c ← c − η_s·ω·c."""
    for eta in rates(t, steps):
        c = c - eta * t.weight_decay * c
    return c


def epochs_of(cfg, clients) -> np.ndarray:
    """Each client's local epochs in round 0: E, or E_i ~ U{1..E} under local_work=uniform_random."""
    from flockfl.rng import np_rng

    t = cfg.train
    if t.local_work == "constant":
        return np.full(len(clients), t.local_epochs)
    return np.array([np_rng(cfg.seed, 0, int(c), "local_work").integers(1, t.local_epochs + 1) for c in clients])


def steps_of(prep, clients, epochs=None) -> np.ndarray:
    """Each client's local steps: train.local_steps, or its epochs × ⌈n_i/B⌉."""
    t = prep.cfg.train
    if t.local_steps is not None and epochs is None:
        return np.full(len(clients), t.local_steps)
    e = epochs_of(prep.cfg, clients) if epochs is None else np.full(len(clients), epochs)
    n = prep.ctx.data.train.sizes[clients]
    return np.array([int(ei) * math.ceil(int(ni) / B) for ei, ni in zip(e, n)])


def trained(state) -> np.ndarray:
    return np.flatnonzero(state.algo["personal"].written())


def cohort(prep) -> np.ndarray:
    return np.sort(prep.algorithm.select(prep.algorithm.init_state(prep.ctx), prep.ctx, 0))


def mean(values, prep, clients, weighting: str) -> float:
    n = prep.ctx.data.train.sizes[clients].astype(np.float64)
    p = n / n.sum() if weighting == "samples" else np.full(len(clients), 1 / len(clients))
    return float(np.dot(p, values))


def assert_counter(got: torch.Tensor, expected: float):
    torch.testing.assert_close(got.double(), torch.full_like(got.double(), expected), rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------------- Ditto
DITTO = [
    ("local_steps", {}, {"local_steps": 2}),
    ("per_client_epochs", {}, {"local_epochs": 3, "local_work": "uniform_random"}),
    ("inverse_schedule", {}, {"lr_schedule": "inverse", "lr_alpha": 0.5, "lr_b": 1.0, "local_epochs": 2}),
    ("sequential_local_steps", {"schedule": "sequential"}, {"local_steps": 2}),
    ("sequential_own_epochs", {"schedule": "sequential", "personal_epochs": 2}, {"local_steps": 3}),
]


@pytest.mark.parametrize("algo,train", [d[1:] for d in DITTO], ids=[d[0] for d in DITTO])
def test_ditto_v_takes_the_steps_of_the_w_pass(algo, train, tmp_path, monkeypatch):
    """v_k takes exactly the global pass's local work, at its rates (or personal_epochs epochs
    for every client under schedule=sequential): with λ = 0.5, v's counter follows
    c ← c − η_s(ωc + λ(c − 1)) (w^t's counter is 1), w's c ← c − η_s·ω·c. Before issue 35, v took
    a whole epoch beside w's train.local_steps, and one epoch beside each client's E_i."""
    lam = 0.5
    cfg = cfg_of("ditto", {"lam": lam, **algo}, train)
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    clients = trained(st)
    np.testing.assert_array_equal(clients, cohort(prep))
    w_steps = steps_of(prep, clients)
    v_steps = steps_of(prep, clients, algo.get("personal_epochs"))
    rows = st.algo["personal"].gather(clients)
    for i, n in enumerate(v_steps):
        c = 1.0
        for eta in rates(cfg.train, int(n)):
            c = c - eta * (OMEGA * c + lam * (c - 1.0))
        assert_counter(rows[BODY][i], c)
        assert_counter(rows[HEAD][i], c)
    assert_counter(st.models[BODY][0], mean([decayed(cfg.train, int(n)) for n in w_steps], prep, clients, "samples"))
    if "personal_epochs" not in algo:
        np.testing.assert_array_equal(v_steps, w_steps)


@pytest.mark.parametrize("engine", ["reference", "vectorized"])
@pytest.mark.parametrize("train,over", [
    ({"local_steps": 3}, {}),
    ({"local_epochs": 4, "local_work": "uniform_random"}, {"seed": 4}),  # its one client draws E_i ≠ 4
    ({}, {"curriculum": {"ordering": "curr", "scoring": "s_G"}}),
], ids=["local_steps", "per_client_epochs", "data_curriculum"])
def test_ditto_interleaved_without_prox_is_the_w_pass_exactly(engine, train, over, tmp_path):
    """λ = 0, interleaved, one client a round: v and w start from w^t and take the same steps on
    the same batches (the curriculum's order and pacing included), so v_k is the aggregated w bit
    for bit. Before issue 35 the v-pass ignored train.local_steps, each client's epochs and the
    data curriculum's order."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    cfg = validate(tiny_config(algorithm={"name": "ditto", "lam": 0.0},
                               train={"engine": engine, "rounds": 1, "clients_per_round": 1, "eval_finetune": "off",
                                      "momentum": 0.5, **train}, **over))
    st = run_rounds(prepare(cfg, tmp_path))
    (client,) = trained(st)
    if cfg.train.local_work != "constant":  # the client's own E_i, not train.local_epochs
        assert epochs_of(cfg, [client])[0] != cfg.train.local_epochs
    v = st.algo["personal"].gather([client])
    for k, w in st.models.items():
        torch.testing.assert_close(v[k], w, rtol=0, atol=0)


def test_ditto_interleaved_refuses_personal_epochs_that_cannot_interleave():
    for algo, train, needle in [({"personal_epochs": 1}, {"local_steps": 2}, "train.local_steps=2"),
                                ({"personal_epochs": 2}, {}, "train.local_epochs=1"),
                                ({"personal_epochs": 1}, {"local_work": "uniform_random"}, "train.local_work")]:
        with pytest.raises(ConfigError) as err:
            cfg_of("ditto", algo, train)
        msg = str(err.value)
        assert "algorithm.personal_epochs" in msg and needle in msg and "\n" not in msg
    cfg_of("ditto", {"personal_epochs": 1})  # = train.local_epochs: nothing to contradict


# ---------------------------------------------------------------------- FedRep
@pytest.mark.parametrize("train", [{}, {"lr_schedule": "inverse", "lr_alpha": 0.5, "lr_b": 1.0}],
                         ids=["constant", "inverse_schedule"])
def test_fedrep_takes_head_epochs_on_the_head_then_body_epochs_on_the_body(train, tmp_path, monkeypatch):
    """τ_h = 2 head epochs (the body frozen), then τ_φ = 1 body epoch (the head frozen), each at
    train.lr on its schedule: the head counter (a personal row) decays over 2⌈n/B⌉ steps, the
    body's over ⌈n/B⌉ (the sample-weighted mean of the cohort's)."""
    cfg = cfg_of("fedrep", {"head_epochs": 2, "body_epochs": 1}, train)
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    clients = trained(st)
    np.testing.assert_array_equal(clients, cohort(prep))
    heads = st.algo["personal"].gather(clients)
    for i, n in enumerate(steps_of(prep, clients, epochs=2)):
        assert_counter(heads[HEAD][i], decayed(cfg.train, int(n)))
    body = [decayed(cfg.train, int(n)) for n in steps_of(prep, clients, epochs=1)]
    assert_counter(st.models[BODY][0], mean(body, prep, clients, "samples"))


@pytest.mark.parametrize("over,needle", [
    ({"train": {"local_steps": 3}}, "train.local_steps: fedrep counts its local work in algorithm.head_epochs"),
    ({"train": {"local_work": "uniform_random"}}, "train.local_work: uniform_random"),
    ({"curriculum": {"ordering": "curr", "scoring": "s_G"}}, "curriculum.ordering: curr would pace fedrep's body"),
])
def test_fedrep_refuses_local_work_it_would_apply_to_one_phase_only(over, needle):
    from flockfl.experiments import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": "fedrep"}, **over))
    assert needle in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------- APFL
@pytest.mark.parametrize("algo", [{}, {"variant": "pfllib"}], ids=["paper", "pfllib"])
@pytest.mark.parametrize("train", [{"local_steps": 3}, {"local_epochs": 2, "local_work": "uniform_random"},
                                   {"lr_schedule": "inverse", "lr_alpha": 0.5, "lr_b": 1.0}],
                         ids=["local_steps", "per_client_epochs", "inverse_schedule"])
def test_apfl_v_and_w_take_the_same_steps_with_weight_decay_and_the_schedule(algo, train, tmp_path, monkeypatch):
    """APFL's (v, α) loop steps v beside every step of w, on w's batches, at train.lr on its
    schedule with train.weight_decay: both counters of v_i and the global w decay over the
    client's local steps (PFLlib's v: the mixture of two equal counters). Before issue 35 the
    loop refused weight decay and the schedule."""
    cfg = cfg_of("apfl", algo, train)
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    clients = trained(st)
    steps = steps_of(prep, clients)
    rows = st.algo["personal"].gather(clients)
    for i, n in enumerate(steps):
        assert_counter(rows[BODY][i], decayed(cfg.train, int(n)))
        assert_counter(rows[HEAD][i], decayed(cfg.train, int(n)))
    assert_counter(st.models[BODY][0], mean([decayed(cfg.train, int(n)) for n in steps], prep, clients, "uniform"))


# ---------------------------------------------------------------------- Per-FedAvg
PERFEDAVG = [
    ("fo_local_steps", {"variant": "fo", "beta": 0.2}, {"local_steps": 4}, 2, 0.2),
    ("hf_local_steps", {"variant": "hf", "beta": 0.2}, {"local_steps": 7}, 2, 0.2),
    ("pfllib_twice_a_round", {"variant": "pfllib"}, {"local_steps": 4}, 4, ETA),
    ("fo_momentum", {"variant": "fo", "beta": 0.2}, {"local_steps": 6, "momentum": 0.5}, 3, 0.2),
    ("fo_inverse_schedule", {"variant": "fo", "beta": 0.2},
     {"local_steps": 6, "lr_schedule": "inverse", "lr_alpha": 0.5, "lr_b": 1.0}, 3, 0.2),
]


@pytest.mark.parametrize("algo,train,meta_steps,beta", [p[1:] for p in PERFEDAVG], ids=[p[0] for p in PERFEDAVG])
def test_perfedavg_takes_one_beta_step_per_meta_step(algo, train, meta_steps, beta, tmp_path, monkeypatch):
    """⌊τ/2⌋ meta-steps for FO (⌊τ/3⌋ for HF), twice a round under variant=pfllib (β = train.lr);
    the α-step adapts a copy, so only the β-steps move w: c ← c − β_t·b with the heavy-ball
    buffer b shared by both steps (b ← ρb + ωc twice per meta-step) and β_t = β·η_t/η on the
    schedule."""
    cfg = cfg_of("perfedavg", algo, train)
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    t = cfg.train
    factors = [r / t.lr for r in rates(t, meta_steps)]
    c, buf = 1.0, 0.0
    for f in factors:
        buf = t.momentum * buf + OMEGA * c  # the α-step (on w, a copy moves)
        buf = t.momentum * buf + OMEGA * c  # the β-step (on the restored w)
        c = c - beta * f * buf
    assert_counter(st.models[BODY][0], c)
    assert_counter(st.models[HEAD][0], c)


def test_perfedavg_takes_each_clients_own_epochs(tmp_path, monkeypatch):
    cfg = cfg_of("perfedavg", {"beta": 0.2}, {"local_epochs": 3, "local_work": "uniform_random"})
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    clients = cohort(prep)
    expected = [(1 - 0.2 * OMEGA) ** (int(n) // 2) for n in steps_of(prep, clients)]  # ⌊E_i⌈n_i/B⌉/2⌋ meta-steps
    assert len(set(expected)) > 1  # the clients' E_i differ
    assert_counter(st.models[BODY][0], mean(expected, prep, clients, "uniform"))


# ---------------------------------------------------------------------- pFedMe
@pytest.mark.parametrize("train", [{"local_steps": 3}, {"local_epochs": 2, "local_work": "uniform_random"},
                                   {"local_steps": 3, "lr_schedule": "inverse", "lr_alpha": 0.5, "lr_b": 1.0}],
                         ids=["local_steps", "per_client_epochs", "inverse_schedule"])
def test_pfedme_takes_R_local_rounds_of_K_inner_steps(train, tmp_path, monkeypatch):
    """R local rounds (one per batch of the client's work), each K inner steps
    θ ← θ − η_p,r(λ(θ − w) + μθ) and one w ← w − η_r·λ(w − θ), both rates on the schedule
    (η_r = η·f_r, η_p,r = η_p·f_r). pFedMe refuses weight decay; its μ (inner_l2) is the
    counter's mover here."""
    lam, k, p_lr, mu = 5.0, 3, 0.09, 0.2
    cfg = cfg_of("pfedme", {"lam": lam, "inner_steps": k, "personal_lr": p_lr, "inner_l2": mu,
                            "train_all_clients": False}, {**train, "weight_decay": 0.0})
    prep, st = counted_run(cfg, tmp_path, monkeypatch)
    clients = trained(st)
    np.testing.assert_array_equal(clients, cohort(prep))
    rows = st.algo["personal"].gather(clients)
    ws = []
    for i, n in enumerate(steps_of(prep, clients)):
        w = theta = 1.0
        for eta in rates(cfg.train, int(n)):
            f = eta / cfg.train.lr
            for _ in range(k):
                theta = theta - p_lr * f * (lam * (theta - w) + mu * theta)
            w = w - eta * lam * (w - theta)
        assert_counter(rows[BODY][i], theta)
        ws.append(w)
    assert_counter(st.models[BODY][0], mean(ws, prep, clients, "samples"))
