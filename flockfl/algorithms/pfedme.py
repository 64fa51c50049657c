"""pFedMe — Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, https://arxiv.org/abs/2006.08848 (code CharlieDinh/pFedMe).

F_i(w) = min_θ {f_i(θ) + (λ/2)‖θ − w‖²}. A training client starts from w_{i,0} = w_t and, for each
of its R local rounds r, one batch D of its round batch order (stream ``shuffle``):

- θ̃ ≈ argmin_θ f_i(θ; D) + (λ/2)‖θ − w_{i,r}‖²: K (``inner_steps``) GD steps at η_p
  (``personal_lr``) on that one batch, warm-started from the previous θ̃ (θ = w_t at the start);
  each step θ ← θ − η_p(∇f_i(θ; D) + λ(θ − w_{i,r}) + μθ), μ = ``inner_l2`` (0: the paper; the
  official code and PFLlib, FL-bench add μ = 1e-3);
- w_{i,r+1} = w_{i,r} − ηλ(w_{i,r} − θ̃)  (η = ``train.lr``).

R (``local_rounds``): null = every batch of ``train.local_epochs`` epochs (or ``train.local_steps``
batches), PFLlib's rule; an integer R = R local rounds of one batch each (the official code's
``local_epochs`` = 20), the batches drawn from the client's batch order cycling over epochs as
needed (``train.local_steps`` = R, which is why the two cannot both be set).

Server: w_{t+1} = (1 − β)w_t + β·Σ p_i w_{i,R} over the sampled cohort S_t (sample-weighted,
the official code). β = 0 freezes w. ``train_all_clients`` (default true: the paper's Algorithm 1
and the official code) has every federating client (``ctx.seen``; newcomers never train) run
its local rounds from w_t every round and set its θ̃_i, while only S_t's w_{i,R} are aggregated:
the global w is the same as with false (only the cohort trains: PFLlib, FL-bench), only the
unsampled clients' θ̃_i differ. The unsampled clients are the round's companions
(``companion_spec``): after the cohort's aggregate the driver trains them from the same w_t
through the same train stage, in ``train.shard_size`` shards that the executor distributes
(their batch orders come from their own (seed, round, client) streams, so the order is
immaterial), a chunk at a time, each chunk's θ̃ written to the client table before the next
(``absorb_companions``): memory holds one chunk's models, never all N. Bytes: |w| down to every
training client (all N under ``train_all_clients``), |w| up from S_t.

The inner solve has two nested loops, which LocalSpec cannot express: it is the round's solver,
run in the train shards, returning w_{i,R} with θ̃_i in the result's meta. The reference trainer
runs :func:`moreau_solver` (a per-client plain PyTorch loop), the vectorised trainer
:func:`moreau_solver_stacked` (the whole cohort at once, one batched gradient per inner step);
tests hold the two to float rounding. Both train BatchNorm on batch statistics and end with each
model's own statistics (precise BN), as the SGD trainers do. Measured on this 2-core CPU (one
round of PFLlib's setting at a tenth of the data, 20 clients, batch 10): the per-client loop is
the faster here (pfllib_cnn 15.1 s vs 77.2 s, MLP 3.0 s vs 4.7 s; FedAvg's own trainers: 3.4 s vs
6.1 s), which ``train.engine=auto`` measures and picks; the cohort solve is for accelerators.
``train.lr_schedule`` acts on both step sizes of local round r, η_r = η·f_r and η_{p,r} = η_p·f_r,
with f_r the schedule's factor at local step r (η = ``train.lr``; TsingZ0/PFLlib's ExponentialLR
decays its personal optimiser's η_p). ``train.weight_decay`` is refused in one line: pFedMe's
L2 term is ``inner_l2`` (μθ in each inner step, the official code's 1e-3; no code decays w).
``train.momentum`` is refused in one line too: the inner solve and the w-step are plain GD/SGD
in the paper and every code.

State: θ̃_i (a detached copy after the last inner solve, never aliased with w_{i,R}) in a
:class:`~flockfl.clientstate.ClientTable` (``state.algo['personal']``); a client never trained
uses the current w. Evaluation: ``accuracy`` (= ``accuracy_personal``) is θ̃_i (pFedMe-PM),
``accuracy_global`` is w (pFedMe-GM).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms.hyper import Hyper, integer, real, weighting
from flockfl.algorithms.personal import PersonalModels, gradient, trained_names
from flockfl.engine.schedule import client_batches, cohort_schedule, stack_schedule
from flockfl.engine.trainers import calibrate_bn, cohort_step, training
from flockfl.engine.update import client_mask
from flockfl.rng import np_rng


def _rates(spec, round: int, steps: int, p_lr: float) -> list[tuple[float, float]]:
    """(η_r, η_{p,r}) of local rounds 0..steps−1: ``train.lr``'s schedule, and η_p scaled by the
    same factor (a constant schedule: (η, η_p) exactly)."""
    lr = float(spec.lr)
    return [(r, p_lr * (r / lr) if lr and r != lr else p_lr) for r in spec.step_rates(round, steps)]


def moreau_pass(model, spec, data, task, seed: int, round: int, lam: float, k_steps: int, p_lr: float,
                mu: float = 0.0):
    """(w_{i,R}, θ̃_i) of every client of ``spec`` (see the module doc); one local round per batch
    of the client's schedule (``spec.steps`` = R, or every batch of ``spec.epochs`` epochs)."""
    names = trained_names(model, spec.init)
    out_w = {k: v.detach().clone() for k, v in spec.init.items()}
    out_t = {k: v.detach().clone() for k, v in spec.init.items()}

    grad_at = gradient(model, names, task)

    def inner(theta, g, w, p_lr):
        if mu:  # the official pFedMeOptimizer's p.grad + λ(p − w) + μp
            return {k: theta[k] - p_lr * (g[k] + lam * (theta[k] - w[k]) + mu * theta[k]) if k in g else w[k]
                    for k in w}
        return {k: theta[k] - p_lr * (g[k] + lam * (theta[k] - w[k])) if k in g else w[k] for k in w}

    for i, cid in enumerate(spec.clients):
        x_c, y_c = data.client(int(cid))
        w = {k: out_w[k][i] for k in out_w}
        theta = dict(w)
        batches = client_batches(len(x_c), spec, np_rng(seed, round, int(cid), spec.stream), i)
        for r, (eta, eta_p) in enumerate(_rates(spec, round, len(batches), p_lr)):
            b = batches[r]
            xb, yb = x_c[torch.as_tensor(b, device=x_c.device)], y_c[torch.as_tensor(b, device=y_c.device)]
            for _ in range(k_steps):
                theta = inner(theta, grad_at(theta, xb, yb), w, eta_p)
            w = {k: w[k] - eta * lam * (w[k] - theta[k]) if k in names else w[k] for k in w}
        for k in out_w:
            out_w[k][i] = w[k]
            out_t[k][i] = theta[k].detach().clone()
    calibrate_bn(model, out_w, data, spec.clients)  # each model's BN statistics under its parameters, as both
    calibrate_bn(model, out_t, data, spec.clients)  # trainers set them ("precise BN")
    return out_w, out_t


def moreau_pass_stacked(model, spec, data, task, seed: int, round: int, lam: float, k_steps: int, p_lr: float,
                        mu: float = 0.0):
    """:func:`moreau_pass` for the whole cohort at once: w and θ stacked on a client axis, each
    inner step one batched gradient (:func:`~flockfl.engine.trainers.cohort_step`) over every
    client's batch of the same local round, in the same batch orders (``cohort_schedule``); a
    client whose local rounds are done neither moves θ nor w. Agrees with the per-client loop to
    float rounding (the batch mean is a weighted sum here)."""
    names = trained_names(model, spec.init)
    device = data.x.device
    w = {k: v.to(device).clone(memory_format=torch.contiguous_format) for k, v in spec.init.items()}
    theta = {k: v.clone() for k, v in w.items()}
    sched = stack_schedule(cohort_schedule(spec, data.sizes, seed, round), data.offsets, spec.clients)
    index, weight = sched.index.to(device), sched.weight.to(device)
    step = cohort_step(model, task)
    rates = _rates(spec, round, sched.steps, p_lr)  # step s of every client is its local round s
    with training(model):
        for s in range(sched.steps):
            x, y, wt = data.x[index[s]], data.y[index[s]], weight[s]
            act = sched.active[s].to(device)
            every = bool(act.all())
            eta, eta_p = rates[s]
            for _ in range(k_steps):
                g, _ = step(theta, x, y, wt)
                with torch.no_grad():
                    for k in names:
                        d = g[k] + lam * (theta[k] - w[k])
                        if mu:
                            d = d + mu * theta[k]
                        d = eta_p * d
                        theta[k] = theta[k] - (d if every else d * client_mask(act, d))
            with torch.no_grad():
                for k in names:
                    d = eta * lam * (w[k] - theta[k])
                    w[k] = w[k] - (d if every else d * client_mask(act, d))
    theta = {k: (theta[k] if k in names else w[k]).detach().clone() for k in w}
    calibrate_bn(model, w, data, spec.clients)
    calibrate_bn(model, theta, data, spec.clients)
    return w, theta


def moreau_solver_stacked(model, spec, data, task):
    """:func:`moreau_solver` by :func:`moreau_pass_stacked` (the vectorised trainer's)."""
    m = spec.meta["pfedme"]
    w, theta = moreau_pass_stacked(model, spec, data, task, int(m["seed"]), int(m["round"]), float(m["lam"]),
                                   int(m["inner_steps"]), float(m["personal_lr"]), float(m["inner_l2"]))
    return w, {"personal": theta}


def moreau_solver(model, spec, data, task):
    """The round's ``solver`` (run by either trainer in the train shards): the clients' (w_{i,R},
    {"personal": θ̃_i}) by :func:`moreau_pass`, with the hyper-parameters in ``spec.meta['pfedme']``."""
    m = spec.meta["pfedme"]
    w, theta = moreau_pass(model, spec, data, task, int(m["seed"]), int(m["round"]), float(m["lam"]),
                           int(m["inner_steps"]), float(m["personal_lr"]), float(m["inner_l2"]))
    return w, {"personal": theta}


TRAINERS_META = "pfedme_trainers"  # state.meta: how many clients train each round (train_all_clients)


class PFedMe(PersonalModels):
    name = "pfedme"
    paper = "Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020, arXiv 2006.08848"
    hyperparameters = (
        weighting("samples", source="code", note="CharlieDinh/pFedMe: the sampled clients' w_{i,R} weighted "
                                                 "n_i/Σ_S n"),
        real("lam", 15.0, "Moreau-envelope regularisation pulling θ towards w (default 15: the official MNIST "
             "comparison)", "λ", gt=0, source="code", note="CharlieDinh/pFedMe README, MNIST comparison: λ = 15"),
        integer("inner_steps", 5, "GD steps of the inner personal solve, on one batch (default 5: the official code)",
                "K", ge=1, source="code", note="CharlieDinh/pFedMe README, main.py: K = 5"),
        real("personal_lr", 0.09, "step size of the inner solve (default 0.09: the official MNIST DNN run)", "η_p",
             gt=0, source="code", note="CharlieDinh/pFedMe README, MNIST comparison: η_p = 0.09 for the DNN (0.1 for MLR)"),
        real("beta", 1.0, "server mixing w ← (1−β)w + β·mean w_i (default 1: the official MNIST comparison; "
             "0 freezes w, > 1 accelerates)", "β", ge=0, source="code",
             note="CharlieDinh/pFedMe README, MNIST comparison: β = 1 (PFLlib's -bt defaults to 0)"),
        integer("local_rounds", None, "local rounds per training round, each one batch (K inner steps, then the "
                "w-step), the batches drawn from the client's batch order cycling over epochs (null: every batch of "
                "train.local_epochs epochs, PFLlib's rule; the official code: 20)", "R", ge=1, optional=True,
                source="library", note="flockfl keeps TsingZ0/PFLlib's R = every batch of E epochs; "
                                       "CharlieDinh/pFedMe main.py: R = local_epochs = 20 batches"),
        real("inner_l2", 0.0, "L2 term μθ added to each inner GD step (default 0: the paper; the official code "
             "1e-3)", "μ", ge=0, source="paper",
             note="the paper's inner problem has no μθ; CharlieDinh/pFedMe pFedMeOptimizer adds μ = 1e-3 "
                  "(PFLlib, FL-bench too)"),
        Hyper("train_all_clients", True, "every federating client runs its local rounds and sets its θ̃_i each "
              "round, only the sampled S_t are aggregated (true: the paper's Algorithm 1 and the official code; "
              "false: only S_t trains, as PFLlib and FL-bench; N/S times less training)", "", "bool",
              source="paper", note="Algorithm 1: all N clients update, the server samples S_t to aggregate; "
                                   "CharlieDinh/pFedMe serverpFedMe.py trains every user, then selects"),
    )

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        r, t = getattr(cfg.algorithm, "local_rounds", None), cfg.train
        if r is not None and t.local_steps is not None:
            raise ValueError(f"algorithm.local_rounds: pfedme takes its R local rounds from algorithm.local_rounds={r} "
                             f"or from train.local_steps={t.local_steps}, not both; drop one of them")
        if r is not None and t.local_work != "constant":
            raise ValueError(f"algorithm.local_rounds: R = {r} fixes every client's local rounds, which "
                             f"train.local_work={t.local_work} would redraw; set train.local_work=constant or drop "
                             "algorithm.local_rounds")

    def init_state(self, ctx):
        state = super().init_state(ctx)
        if not self.hp("train_all_clients"):
            return state
        return state.replace(meta={**state.meta, TRAINERS_META: int(len(ctx.seen))})

    def round_spec(self, state, ctx, clients, round):
        """FedAvg's spec with R local rounds when ``local_rounds`` is set (``steps`` = R)."""
        spec = super().local_spec(state, ctx, clients, round)
        r = self.hp("local_rounds")
        return spec if r is None else dataclasses.replace(spec, steps=int(r), client_epochs=None)

    def moreau_spec(self, state, ctx, clients, round):
        """The round's spec for ``clients``: their local rounds from w_t, solved by
        :func:`moreau_solver` inside the train stage (sharded, distributed by the executor)."""
        spec = self.round_spec(state, ctx, clients, round)
        spec.meta = {**spec.meta, "pfedme": {"seed": int(ctx.seed), "round": int(round), "lam": float(self.hp("lam")),
                                             "inner_steps": int(self.hp("inner_steps")),
                                             "personal_lr": float(self.hp("personal_lr")),
                                             "inner_l2": float(self.hp("inner_l2"))}}
        spec.solver, spec.solver_vectorized = moreau_solver, moreau_solver_stacked
        return spec

    def local_spec(self, state, ctx, clients, round):
        return self.moreau_spec(state, ctx, clients, round)

    def companion_spec(self, state, ctx, spec, round):
        """Under ``train_all_clients``, the federating clients outside the cohort: they run their
        local rounds from the same w_t; only their θ̃ are kept."""
        if not self.hp("train_all_clients"):
            return None
        others = np.setdiff1d(np.asarray(ctx.seen, np.int64), np.asarray(spec.clients, np.int64))
        return self.moreau_spec(state, ctx, others, round) if len(others) else None

    def aggregate(self, state, ctx, spec, result, assign):
        """w ← (1 − β)w + β·Σ p_i w_{i,R}; θ̃ of the trained clients to their rows."""
        beta = float(self.hp("beta"))
        mean = weighted_mean(result.params, self.weights(result, np.arange(len(result.clients))))
        models = {k: ((1 - beta) * v[0] + beta * mean[k]).unsqueeze(0) for k, v in state.models.items()}
        new = self._with_assignments(state, models, result.clients, assign)
        return self.absorb_companions(new.replace(algo=state.algo), ctx, result)

    def absorb_companions(self, state, ctx, result):
        """The trained clients' θ̃ to their rows (a companion's w_{i,R} is dropped)."""
        table = state.algo["personal"].scatter(result.clients, result.meta["personal"])
        return state.replace(algo={**state.algo, "personal": table})

    def comm_bytes(self, state, clients):
        """|w| down to every training client (all federating clients under ``train_all_clients``),
        |w| up from the cohort."""
        per = self.model_bytes(state)
        return int(state.meta.get(TRAINERS_META, len(clients))) * per, len(clients) * per

    def sim_round_time(self, state, ctx, clients, steps):
        """The slowest cohort client's compute + one model each way."""
        per = self.model_bytes(state)
        return ctx.system.round_time(clients, steps, per / 1e6, per / 1e6)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global w"
