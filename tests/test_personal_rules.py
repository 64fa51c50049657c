"""Each personalised method's update rule, pinned to values computed here by hand (issue 35).

The per-client loops (APFL's (v, α) pass, Per-FedAvg's meta-steps, pFedMe's Moreau loop, Ditto's
proximal pass) run on a 2→2 linear softmax model in float64, two clients of 4 and 6 samples, a
few steps of batch 2. The expected values come from the papers' equations written out with the
closed-form gradient of the mean cross-entropy of softmax(XWᵀ + b), ∇_W = (P − Y)ᵀX/n and
∇_b = mean(P − Y), and its closed-form Hessian-vector product; only the batch order is read
from flockfl (``client_batches``: which samples a step uses is the schedule's, not the rule's).

The partial-sharing methods (FedPer, LG-FedAvg, FedRep, FedBABU) run one real round on the
tiny digits experiment with a 4-unit MLP, full batches (so every step uses a client's whole
data) and 2 local epochs; the expectation is that round written out: full-batch gradient
descent by autograd on a hand-written forward pass of the parts each method trains, then the
server mean of the shared parts. FedBN's rule is which tensors the server averages: the
expectation takes the trained clients' models from the trainer and splits them by hand.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config

from flockfl.engine.data import Split
from flockfl.engine.schedule import LocalSpec, LrSchedule, client_batches
from flockfl.rng import np_rng

SEED, ROUND, TASK = 5, 2, "classification"
SIZES = (4, 6)


# ---------------------------------------------------------------------- the tiny problem, by hand
def problem():
    """A 2→2 linear model (float64), two clients' data, and a start point."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES), 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0])
    data = Split(x, y, np.array([0, SIZES[0], sum(SIZES)]))
    model = nn.Linear(2, 2).double()
    w0 = {"weight": torch.randn(2, 2, generator=g, dtype=torch.float64),
          "bias": torch.randn(2, generator=g, dtype=torch.float64)}
    v0 = {"weight": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
          "bias": torch.randn(2, 2, generator=g, dtype=torch.float64)}  # a different v per client
    return model, data, w0, v0


def stacked(p: dict, n: int = 2) -> dict:
    return {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in p.items()}


def spec_of(w0: dict, **over) -> LocalSpec:
    base = dict(clients=np.array([0, 1]), init=stacked(w0), lr=0.1, epochs=1, steps=2, batch_size=2)
    return LocalSpec(**{**base, **over})


def batches_of(spec: LocalSpec, data: Split, i: int, stream: str = "shuffle") -> list[np.ndarray]:
    n = int(data.sizes[i])
    return client_batches(n, spec, np_rng(SEED, ROUND, i, stream), i)


def grad(p: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    """∇ of the mean cross-entropy of softmax(x Wᵀ + b): ((P − Y)ᵀx/n, mean(P − Y))."""
    d = (torch.softmax(x @ p["weight"].T + p["bias"], 1) - nn.functional.one_hot(y, 2).double()) / len(y)
    return {"weight": d.T @ x, "bias": d.sum(0)}


def hvp(p: dict, x: torch.Tensor, dp: dict) -> dict:
    """The Hessian of the same loss at p times the direction dp: J = P⊙Δz − P(PᵀΔz) per sample."""
    prob = torch.softmax(x @ p["weight"].T + p["bias"], 1)
    dz = x @ dp["weight"].T + dp["bias"]
    j = (prob * dz - prob * (prob * dz).sum(1, keepdim=True)) / len(x)
    return {"weight": j.T @ x, "bias": j.sum(0)}


def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(x @ p["weight"].T + p["bias"], y))


def axpy(a: float, x: dict, y: dict) -> dict:
    """a·x + y."""
    return {k: a * x[k] + y[k] for k in y}


def dot(a: dict, b: dict) -> float:
    return float(sum((a[k] * b[k]).sum() for k in a))


def inverse(lr: float, steps: int, a: float = 0.5, b: float = 1.0) -> list[float]:
    return [lr * (1 + a * i) ** -b for i in range(steps)]


def close(got: dict, want: dict, i: int | None = None, tol: float = 1e-12):
    for k in want:
        g = got[k][i] if i is not None else got[k]
        torch.testing.assert_close(g, want[k], rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------- APFL
APFL = [
    # name, spec overrides, (adaptive, alpha_lr, alpha_l2), variant
    ("alpha_0.3", {}, (True, 0.5, 0.02), "paper"),
    ("alpha_0.3_decay_momentum_inverse", {"weight_decay": 0.05, "momentum": 0.9,
                                          "lr_schedule": LrSchedule("inverse", 0.5, 1.0)}, (True, None, 0.0), "paper"),
    ("alpha_0.3_fixed", {}, (False, 0.5, 0.0), "paper"),
    ("pfllib", {}, (True, 0.5, 0.02), "pfllib"),
    ("pfllib_decay_inverse", {"weight_decay": 0.05, "lr_schedule": LrSchedule("inverse", 0.5, 1.0)},
     (True, None, 0.02), "pfllib"),
    ("alpha_0.3_pruned_w", {"masks": {"weight": torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]]],
                                                             dtype=torch.float64)}}, (True, 0.5, 0.02), "paper"),
]


def apfl_by_hand(v, w, a, batches, x, y, rates, wd, rho, adaptive, alpha_lr, c, variant, mask=None):
    """The paper's APFL step (v ← v − η∇_v f(v̄), v̄ = αv + (1 − α)w; w ← w − η∇f(w); α ← clip(α −
    η_α(<v − w, ∇f(v̄)> + cα))), or PFLlib's (v on f(v), α after the steps, v ← αv + (1 − α)w at the
    end), with torch's SGD weight decay and heavy ball on each model (a pruning ``mask`` on w's
    steps, as the trainer applies it)."""
    mask = mask or {}
    bv = {k: torch.zeros_like(t) for k, t in v.items()}
    bw = {k: torch.zeros_like(t) for k, t in w.items()}
    for s, idx in enumerate(batches):
        xb, yb = x[idx], y[idx]
        eta = rates[s]
        eta_a = eta if alpha_lr is None else alpha_lr
        if variant == "paper":
            vbar = {k: a * v[k] + (1 - a) * w[k] for k in v}
            g_bar, g_w = grad(vbar, xb, yb), grad(w, xb, yb)
            g_v = {k: a * g_bar[k] for k in v}  # ∂f(αv + (1 − α)w)/∂v = α∇f(v̄)
            a_next = a - eta_a * (dot({k: v[k] - w[k] for k in v}, g_bar) + c * a) if adaptive else a
        else:
            g_v, g_w = grad(v, xb, yb), grad(w, xb, yb)
        bv = {k: rho * bv[k] + g_v[k] + wd * v[k] for k in v}
        bw = {k: rho * bw[k] + g_w[k] + wd * w[k] for k in w}
        v = {k: v[k] - eta * bv[k] for k in v}
        w = {k: w[k] - eta * bw[k] * mask.get(k, 1.0) for k in w}
        if variant == "pfllib" and adaptive:
            mixed = {k: a * g_v[k] + (1 - a) * g_w[k] for k in v}
            a_next = a - eta_a * (dot({k: v[k] - w[k] for k in v}, mixed) + c * a)
        elif variant == "pfllib":
            a_next = a
        a = min(1.0, max(0.0, a_next))
    if variant == "pfllib":
        v = {k: (1 - a) * w[k] + a * v[k] for k in v}
    return v, w, a


@pytest.mark.parametrize("over,alpha_rule,variant", [a[1:] for a in APFL], ids=[a[0] for a in APFL])
def test_apfl_v_w_and_alpha_by_hand(over, alpha_rule, variant):
    from flockfl.algorithms.apfl import personal_pass
    from flockfl.engine import TRAINERS

    model, data, w0, v0 = problem()
    adaptive, alpha_lr, c = alpha_rule
    spec = spec_of(w0, **over)
    got_v, got_a = personal_pass(model, spec, data, TASK, SEED, ROUND, v0, torch.full((2,), 0.3, dtype=torch.float64),
                                 adaptive, alpha_lr, c, "params", variant)
    got_w = TRAINERS["reference"](model, spec, data, TASK, SEED, ROUND).params
    for i in range(2):
        x, y = data.client(i)
        batches = batches_of(spec, data, i)
        v, w, a = apfl_by_hand({k: t[i] for k, t in v0.items()}, dict(w0), 0.3, batches, x, y,
                               inverse(0.1, len(batches)) if "lr_schedule" in over else [0.1] * len(batches),
                               spec.weight_decay, spec.momentum, adaptive, alpha_lr, c, variant,
                               {k: m[i] for k, m in (spec.masks or {}).items()})
        close(got_v, v, i)
        close(got_w, w, i, tol=1e-10)  # the trainer's w is the loop's
        assert float(got_a[i]) == pytest.approx(a, rel=1e-12, abs=1e-14)
        assert (a != 0.3) == adaptive  # α took its own gradient steps (or stayed fixed)


def test_apfl_alpha_gradient_is_the_derivative_of_the_mixture_loss():
    """<v − w, ∇f(v̄)> = ∂f(αv + (1 − α)w)/∂α (the paper's α-gradient), by central differences."""
    _, data, w, v0 = problem()
    v = {k: t[0] for k, t in v0.items()}
    x, y = data.client(1)
    a, eps = 0.3, 1e-6
    mix = lambda al: {k: al * v[k] + (1 - al) * w[k] for k in v}  # noqa: E731
    fd = (loss(mix(a + eps), x, y) - loss(mix(a - eps), x, y)) / (2 * eps)
    assert dot({k: v[k] - w[k] for k in v}, grad(mix(a), x, y)) == pytest.approx(fd, rel=1e-7)


def test_apfl_output_mixing_by_hand():
    """mix=outputs: ŷ = αXvᵀ + (1 − α)Xwᵀ (+ biases), v ← v − η·α(P̂ − Y)ᵀX/n (f(x; w) held fixed),
    α ← clip(α − η_α(mean <P̂ − Y, f(x; v) − f(x; w)> + cα))."""
    from flockfl.algorithms.apfl import personal_pass

    model, data, w0, v0 = problem()
    spec = spec_of(w0)
    got_v, got_a = personal_pass(model, spec, data, TASK, SEED, ROUND, v0, torch.full((2,), 0.3, dtype=torch.float64),
                                 True, 0.5, 0.02, "outputs")
    for i in range(2):
        x, y = data.client(i)
        v, w, a = {k: t[i] for k, t in v0.items()}, dict(w0), 0.3
        for idx in batches_of(spec, data, i):
            xb, yb = x[idx], y[idx]
            fv, fw = xb @ v["weight"].T + v["bias"], xb @ w["weight"].T + w["bias"]
            d = (torch.softmax(a * fv + (1 - a) * fw, 1) - nn.functional.one_hot(yb, 2).double()) / len(yb)
            g_v = {"weight": a * d.T @ xb, "bias": a * d.sum(0)}
            a_next = min(1.0, max(0.0, a - 0.5 * (float((d * (fv - fw)).sum()) + 0.02 * a)))
            v = {k: v[k] - 0.1 * g_v[k] for k in v}
            w = {k: w[k] - 0.1 * gw for k, gw in grad(w, xb, yb).items()}
            a = a_next
        close(got_v, v, i)
        assert float(got_a[i]) == pytest.approx(a, rel=1e-12)


# ---------------------------------------------------------------------- Per-FedAvg
PERFEDAVG = [
    # name, variant, spec overrides, passes
    ("fo", "fo", {}, 1),
    ("hf", "hf", {"steps": 6}, 1),
    ("fo_decay_momentum_inverse", "fo", {"steps": 4, "weight_decay": 0.05, "momentum": 0.5,
                                         "lr_schedule": LrSchedule("inverse", 0.5, 1.0)}, 1),
    ("hf_decay_momentum_inverse", "hf", {"steps": 6, "weight_decay": 0.05, "momentum": 0.5,
                                         "lr_schedule": LrSchedule("inverse", 0.5, 1.0)}, 1),
    ("pfllib_two_passes", "fo", {"steps": 4}, 2),
]


@pytest.mark.parametrize("variant,over,passes", [p[1:] for p in PERFEDAVG], ids=[p[0] for p in PERFEDAVG])
def test_perfedavg_meta_step_by_hand(variant, over, passes):
    """Per meta-step t on batches D, D' (D''): w̃ = w − α_t(∇f(w; D) + ωw) (through the shared
    momentum buffer), g = ∇f(w̃; D'); HF: g ← g − α_t[∇f(w + δg; D'') − ∇f(w − δg; D'')]/(2δ)
    (which is the Hessian-vector product ∇²f(w; D'')g to O(δ²)); w ← w − β_t(g + ωw) (through the
    buffer); α_t, β_t on the schedule. variant=pfllib: the meta-steps of two passes, the second
    on its own batch order."""
    from flockfl.algorithms.perfedavg import maml_solver

    model, data, w0, _ = problem()
    alpha, beta, delta = 0.05, 0.1, 1e-3
    spec = spec_of(w0, **{"steps": 4, **over})
    spec.meta = {"perfedavg": {"variant": variant, "alpha": alpha, "beta": beta, "delta": delta, "passes": passes,
                               "seed": SEED, "round": ROUND}}
    got = maml_solver(model, spec, data, TASK)
    wd, rho, per = spec.weight_decay, spec.momentum, 3 if variant == "hf" else 2
    for i in range(2):
        x, y = data.client(i)
        groups = []
        for p in range(passes):
            b = batches_of(spec, data, i, "shuffle" if p == 0 else "shuffle/second")
            groups += [b[per * t: per * t + per] for t in range(len(b) // per)]
        assert len(groups) == passes * spec.steps // per
        f = inverse(1.0, len(groups)) if "lr_schedule" in over else [1.0] * len(groups)
        w, buf = dict(w0), {k: torch.zeros_like(t) for k, t in w0.items()}
        for t, group in enumerate(groups):
            (x0, y0), (x1, y1) = (x[group[0]], y[group[0]]), (x[group[1]], y[group[1]])
            buf = {k: rho * buf[k] + g + wd * w[k] for k, g in grad(w, x0, y0).items()}
            w_tilde = axpy(-alpha * f[t], buf, w)
            g = grad(w_tilde, x1, y1)
            if variant == "hf":
                x2, y2 = x[group[2]], y[group[2]]
                d = {k: (gp - gm) / (2 * delta) for (k, gp), gm in
                     zip(grad(axpy(delta, g, w), x2, y2).items(), grad(axpy(-delta, g, w), x2, y2).values())}
                close(d, hvp(w, x2, g), tol=1e-5)  # the finite difference is the Hessian-vector product
                g = axpy(-alpha * f[t], d, g)
            buf = {k: rho * buf[k] + g[k] + wd * w[k] for k in w}
            w = axpy(-beta * f[t], buf, w)
        close(got, w, i)


# ---------------------------------------------------------------------- pFedMe
@pytest.mark.parametrize("over,mu", [({}, 0.0), ({"steps": 3}, 0.001),
                                     ({"steps": 3, "lr_schedule": LrSchedule("inverse", 0.5, 1.0)}, 0.001)],
                         ids=["paper", "inner_l2", "inverse_schedule"])
@pytest.mark.parametrize("solver", ["moreau_pass", "moreau_pass_stacked"])
def test_pfedme_moreau_step_by_hand(over, mu, solver):
    """Per local round r on batch D: K steps θ ← θ − η_p,r(∇f(θ; D) + λ(θ − w) + μθ) from the last
    θ (θ = w at the start), then w ← w − η_r·λ(w − θ) (η_r, η_p,r on the schedule); θ̃_i is the last
    θ, w_{i,R} the last w. Both solvers (per client, and the cohort at once) give it."""
    import flockfl.algorithms.pfedme as pfedme

    model, data, w0, _ = problem()
    lam, k_steps, p_lr = 3.0, 4, 0.2
    spec = spec_of(w0, **over)
    got_w, got_t = getattr(pfedme, solver)(model, spec, data, TASK, SEED, ROUND, lam, k_steps, p_lr, mu)
    for i in range(2):
        x, y = data.client(i)
        batches = batches_of(spec, data, i)
        f = inverse(1.0, len(batches)) if "lr_schedule" in over else [1.0] * len(batches)
        w = dict(w0)
        theta = dict(w)
        for r, idx in enumerate(batches):
            for _ in range(k_steps):
                g = grad(theta, x[idx], y[idx])
                theta = {k: theta[k] - p_lr * f[r] * (g[k] + lam * (theta[k] - w[k]) + mu * theta[k]) for k in w}
            w = {k: w[k] - 0.1 * f[r] * lam * (w[k] - theta[k]) for k in w}
        close(got_w, w, i, tol=1e-10)
        close(got_t, theta, i, tol=1e-10)
        assert not torch.equal(got_t["weight"][i], got_w["weight"][i])


# ---------------------------------------------------------------------- Ditto
@pytest.mark.parametrize("engine", ["reference", "vectorized"])
@pytest.mark.parametrize("over", [{}, {"weight_decay": 0.05, "momentum": 0.9, "lr_schedule": LrSchedule("inverse", 0.5, 1.0),
                                       "steps": 3}], ids=["plain", "decay_momentum_inverse"])
def test_ditto_proximal_step_by_hand(engine, over):
    """v ← v − η_s(∇f(v; b) + λ(v − w^t) + ωv) through a heavy-ball buffer, on the w-pass's
    batches, anchored to the round-start w^t (not to v, not to the moving w)."""
    from flockfl.algorithms.ditto import Ditto
    from flockfl.engine.schedule import SecondPass

    model, data, w0, v0 = problem()
    lam = 0.7
    spec = spec_of(w0, **over)
    spec.second = SecondPass("ditto", v0, stacked(w0), {"lam": lam, "epochs": None, "stream": "shuffle"})
    got = Ditto.second_pass(model, spec, data, TASK, engine, SEED, ROUND)
    wd, rho = spec.weight_decay, spec.momentum
    for i in range(2):
        x, y = data.client(i)
        batches = batches_of(spec, data, i)
        rates = inverse(0.1, len(batches)) if "lr_schedule" in over else [0.1] * len(batches)
        v = {k: t[i] for k, t in v0.items()}
        buf = {k: torch.zeros_like(t) for k, t in v.items()}
        for s, idx in enumerate(batches):
            g = grad(v, x[idx], y[idx])
            buf = {k: rho * buf[k] + g[k] + wd * v[k] + lam * (v[k] - w0[k]) for k in v}
            v = axpy(-rates[s], buf, v)
        close(got, v, i, tol=1e-10)


def test_ditto_best_of_reports_the_better_of_personal_and_global(tmp_path):
    """eval=best_of (PFLlib's leaderboard): every mean accuracy of the personal family is
    max(v_k's, w's) under the same convention; the personal and global families are untouched."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    rows = {}
    for mode in ("personal", "best_of"):
        cfg = validate(tiny_config(algorithm={"name": "ditto", "eval": mode},
                                   train={"rounds": 2, "eval_finetune": "off"}))
        rows[mode] = run_rounds(prepare(cfg, tmp_path / mode)).history
    keys = [k for k in rows["personal"][-1] if k == "accuracy" or (k.startswith("accuracy__") and k.count("__") == 2)]
    assert len(keys) > 2
    for p, b in zip(rows["personal"], rows["best_of"]):
        for k in keys:
            g = "accuracy_global" + k[len("accuracy"):]
            assert b[k] == max(p[k], p[g]) and b[g] == p[g]
        assert b["accuracy_personal"] == p["accuracy_personal"] == p["accuracy"]


# ---------------------------------------------------------------------- the partial-sharing methods
SPLIT = {"model": {"name": "mlp", "hidden": 4}, "partition": {"scheme": "rotated", "num_clients": 6, "k": 2},
         "train": {"rounds": 1, "clients_per_round": 3, "local_epochs": 2, "full_batch": True, "lr": 0.5,
                   "engine": "reference", "eval_finetune": "off"}}


def one_round(name: str, tmp_path, **algo):
    from flockfl.config import deep_merge
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    cfg = validate(tiny_config(**deep_merge(SPLIT, {"algorithm": {"name": name, **algo}})))
    prep = prepare(cfg, tmp_path)
    start = prep.algorithm.init_state(prep.ctx)
    clients = np.sort(prep.algorithm.select(start, prep.ctx, 0))
    return prep, {k: v[0] for k, v in start.models.items()}, clients, run_rounds(prep)


def gd(p: dict, x: torch.Tensor, y: torch.Tensor, steps: int, keys, lr: float = 0.5) -> dict:
    """``steps`` full-batch gradient steps on the ``keys`` of the MLP relu(x W1ᵀ + b1) W2ᵀ + b2."""
    p = {k: v.clone() for k, v in p.items()}
    for _ in range(steps):
        leaves = {k: p[k].clone().requires_grad_(True) for k in keys}
        q = {**p, **leaves}
        h = torch.relu(x.flatten(1) @ q["1.weight"].T + q["1.bias"])
        out = nn.functional.cross_entropy(h @ q["3.weight"].T + q["3.bias"], y)
        grads = torch.autograd.grad(out, [leaves[k] for k in keys])
        p.update({k: (p[k] - lr * g).detach() for k, g in zip(keys, grads)})
    return p


def server_mean(models: list[dict], keys, sizes, weighting: str) -> dict:
    p = np.asarray(sizes, np.float64)
    p = p / p.sum() if weighting == "samples" else np.full(len(models), 1 / len(models))
    return {k: sum(float(pi) * m[k].double() for pi, m in zip(p, models)) for k in keys}


BODY_KEYS, HEAD_KEYS = ("1.weight", "1.bias"), ("3.weight", "3.bias")
SPLITS = [
    # name, algorithm keys, personal keys, [(steps, trained keys)] per phase, weighting
    ("fedper", {}, HEAD_KEYS, [(2, BODY_KEYS + HEAD_KEYS)], "samples"),
    ("lg_fedavg", {"global_layers": "top:1"}, BODY_KEYS, [(2, BODY_KEYS + HEAD_KEYS)], "samples"),
    ("fedrep", {"head_epochs": 2, "body_epochs": 1}, HEAD_KEYS, [(2, HEAD_KEYS), (1, BODY_KEYS)], "samples"),
    ("fedbabu", {}, HEAD_KEYS, [(2, BODY_KEYS)], "uniform"),
]


@pytest.mark.parametrize("name,algo,personal,phases,weighting", SPLITS, ids=[s[0] for s in SPLITS])
def test_partial_sharing_round_by_hand(name, algo, personal, phases, weighting, tmp_path):
    """One round from the seeded init: each sampled client trains the parts its method trains
    (FedPer, LG: everything jointly; FedRep: the head, then the body; FedBABU: the body, the head
    frozen at init); the server sets the shared parts to the mean of the clients' (n_i-weighted,
    or uniform for FedBABU); each client keeps its personal parts (FedBABU keeps none: its head
    is the init for everyone)."""
    prep, init, clients, st = one_round(name, tmp_path, **algo)
    assert set(prep.algorithm.names(st)) == set(personal)
    trained = []
    for c in clients:
        x, y = prep.ctx.data.train.client(int(c))
        p = {k: v.double() for k, v in init.items()}
        for steps, keys in phases:
            p = gd(p, x.double(), y, steps, keys)
        trained.append(p)
    shared = [k for k in init if k not in personal]
    want = server_mean(trained, shared, prep.ctx.data.train.sizes[clients], weighting)
    for k in shared:
        torch.testing.assert_close(st.models[k][0].double(), want[k], rtol=1e-5, atol=1e-6, msg=k)
    if name == "fedbabu":  # the head never moves and is never anyone's own
        for k in personal:
            assert torch.equal(st.models[k][0], init[k])
        assert "personal" not in st.algo
        return
    rows = st.algo["personal"].gather(clients)
    for i, p in enumerate(trained):
        for k in personal:
            torch.testing.assert_close(rows[k][i].double(), p[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in personal:  # the server's copy of a personal part is untouched (the init a newcomer starts from)
        assert torch.equal(st.models[k][0], init[k])


def test_fedbn_averages_everything_but_the_batchnorm_tensors(tmp_path):
    """FedBN: every non-BN tensor is the uniform mean of the trained clients'; every BN tensor,
    affine γ, β and running mean and variance, is each client's own (its row), never averaged."""
    from flockfl.config import deep_merge
    from flockfl.engine import TRAINERS
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    cfg = validate(tiny_config(**deep_merge(SPLIT, {"model": {"name": "lenet5_bn"}, "algorithm": {"name": "fedbn"}})))
    prep = prepare(cfg, tmp_path)
    start = prep.algorithm.init_state(prep.ctx)
    clients = prep.algorithm.select(start, prep.ctx, 0)
    spec = prep.algorithm.local_spec(start, prep.ctx, clients, 0)
    res = TRAINERS["reference"](prep.ctx.model, spec, prep.ctx.data.train, TASK, prep.ctx.seed, 0)
    st = run_rounds(prep)
    bn = [n for n, m in prep.ctx.model.named_modules() if "BatchNorm" in type(m).__name__]
    local = [k for k in start.models if any(k.startswith(b + ".") for b in bn)]
    assert any(k.endswith("running_var") for k in local) and any(k.endswith("weight") for k in local)
    assert set(prep.algorithm.names(st)) == set(local)
    for k in start.models:
        if k in local:
            rows = st.algo["personal"].gather(res.clients)[k]
            torch.testing.assert_close(rows, res.params[k], rtol=0, atol=0)
            assert torch.equal(st.models[k][0], start.models[k][0])
        else:
            want = res.params[k].double().mean(0)
            torch.testing.assert_close(st.models[k][0].double(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- what an own loop cannot take
@pytest.mark.parametrize("over,needle", [
    ({"algorithm": {"name": "pfedme"}, "train": {"weight_decay": 1e-4}}, "train.weight_decay: 0.0001 pfedme's L2 term "
                                                                         "is algorithm.inner_l2"),
    ({"algorithm": {"name": "pfedme"}, "train": {"momentum": 0.5}}, "train.momentum: 0.5 pfedme's inner solve"),
    ({"dataset": {"name": "synthetic_linreg", "clusters": 2, "dim": 10, "samples_per_client": 40},
      "partition": {"scheme": "natural", "num_clients": 16}, "model": {"name": "linear"},
      "train": {"full_batch": True, "momentum": 0.9}, "algorithm": {"name": "fedsplit", "prox": "exact"}},
     "train.momentum: 0.9 acts in the trainers' SGD step, but fedsplit"),
    ({"algorithm": {"name": "perfedavg", "variant": "pfllib", "beta": 0.01}},
     "algorithm.beta: variant=pfllib sets α = β = train.lr"),
    ({"algorithm": {"name": "apfl", "variant": "pfllib", "mix": "outputs"}},
     "algorithm.variant: pfllib mixes parameters after the round"),
])
def test_an_optimiser_term_an_own_loop_has_no_place_for_is_refused_in_one_line(over, needle):
    """No silent ignore: pFedMe's L2 is inner_l2 and its steps are plain; FedSplit's exact prox has
    no steps (APFL and Per-FedAvg take all three terms: the tests above); PFLlib's Per-FedAvg has
    no α or β of its own, PFLlib's APFL no output mixing."""
    from flockfl.errors import ConfigError
    from flockfl.experiments import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    assert needle in str(err.value) and "\n" not in str(err.value)
