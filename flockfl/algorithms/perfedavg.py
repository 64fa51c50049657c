"""Per-FedAvg — Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, https://arxiv.org/abs/2002.07948.

Objective F(w) = (1/n) Σ_i f_i(w − α∇f_i(w)). A selected client starts from w and takes, per
meta-step t, on consecutive batches D_t, D'_t (and D''_t) of its round batch order (stream
``shuffle``, E epochs: len//2 meta-steps for FO, len//3 for HF, as the PACFL and FL-bench codes):

- adaptation w̃ = w − α∇f_i(w; D_t);
- FO (``variant=fo``): w ← w − β∇f_i(w̃; D'_t);
- HF (``variant=hf``): g = ∇f_i(w̃; D'_t), d = [∇f_i(w + δg; D''_t) − ∇f_i(w − δg; D''_t)]/(2δ),
  w ← w − β(g − αd).

The server takes the uniform mean (the paper). The meta-step needs two or three batches per
update, which LocalSpec cannot express, so it runs as a ``solver``: a per-client plain PyTorch
loop that both trainers call. α = 0 is FedAvg at lr β on the D' batches.

The loop's optimiser is one SGD over the model's parameters that serves both steps of a
meta-step, its lr switched between them (MMorafah/PACFL client_per_fedavg.py, the thesis's
code; TsingZ0/PFLlib's PerAvgOptimizer likewise), so ``train.*`` acts on both:

- ``train.weight_decay`` ω: g + ω·w on the parameters the step moves (w in the α-step, the
  restored w in the β-step), as torch's SGD weight_decay (KarhouTam/FL-bench's α-step optimiser
  takes the configured weight decay; flockfl's one optimiser takes it in both steps);
- ``train.momentum`` ρ: one heavy-ball buffer, reset every round, shared by the α- and
  β-steps (b ← ρb + g; the step moves by its lr times b): the PACFL code's single
  SGD(momentum=0.5), whose buffer mixes the two steps (the thesis's Per-FedAvg runs with 0.5);
  0 is the paper's plain SGD;
- ``train.lr_schedule``: meta-step t scales both of its step sizes, α_t = α·η_t/η and
  β_t = β·η_t/η, by the schedule's factor at local step t (η = ``train.lr``; PFLlib's
  ExponentialLR decays its optimiser's lr, the α-step's there), also in the HF correction.

**PFLlib's Per-FedAvg** (``variant=pfllib``, TsingZ0/PFLlib clientperavg.py, serverperavg.py): FO
with α = β = ``train.lr`` (``self.beta = self.learning_rate``; setting ``alpha`` or ``beta`` is
then a config error), and the server calls ``client.train()`` **twice** a round: the meta-steps
run over two passes of the client's local work, each with its own batch order (the first from
the round's stream, the second from ``<stream>/second``), the momentum buffer and the schedule's
step count running on across them. Evaluation as the paper's (one step at α = ``train.lr`` on a
training batch: PFLlib's ``train_one_step``). PFLlib draws the pair (D, D') as the halves of one
batch of 2B with ``drop_last``; here they are consecutive batches of B of the round's order.

Evaluation (``eval_model``): ``accuracy`` (= ``accuracy_personal``) is

- ``adapt`` (default, the paper): w after ``adapt_steps`` (default 1) SGD steps at lr α on the
  client's *training* batches (size B, stream (seed, round, client, ``perfedavg_adapt``)), run by
  the run's trainer (PFLlib's evaluation: one step on one training batch);
- ``finetune`` (KarhouTam/FL-bench, whose ``finetune_epoch`` is at least 1): w after one epoch of
  full-model SGD at lr α on the client's training data (batches of B, stream ``perfedavg_finetune``);
- ``last_local`` (the PACFL thesis's code, MMorafah/PACFL): the client's model after its last
  local training (its w^i after the meta-steps of the last round it was sampled in), with no
  extra step. Those models are kept per client in a :class:`~flockfl.clientstate.ClientTable`
  (``state.algo['personal']``, written for the clients that trained); a client never trained
  (and a newcomer) falls back to the current global w.

``accuracy_global`` is w. Plain SGD (no momentum) in every evaluation pass. No per-client state
but under ``last_local``. Newcomers join with the global w, then take ``train.finetune_epochs``
epochs of SGD from their evaluation model (adapted, fine-tuned, or w).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.aggregation import broadcast
from flockfl.algorithms.personal import PersonalModels, gradient, trained_names
from flockfl.client import pass_spec, train_pass
from flockfl.engine.schedule import client_batches
from flockfl.engine.trainers import calibrate_bn
from flockfl.rng import np_rng


SECOND = "/second"  # variant=pfllib: the stream suffix of the second pass's batch order

EVAL_MODELS = ("adapt", "finetune", "last_local")


def maml_solver(model, spec, data, task) -> dict[str, torch.Tensor]:
    """Per-FedAvg's local meta-steps for every client of ``spec`` (``spec.meta['perfedavg']``:
    variant, alpha, beta, delta, passes, seed, round; ``spec``'s lr schedule, weight decay and
    momentum: the module doc)."""
    m = spec.meta["perfedavg"]
    alpha, beta, delta, hf = float(m["alpha"]), float(m["beta"]), float(m["delta"]), m["variant"] == "hf"
    passes, seed, round = int(m.get("passes", 1)), m["seed"], m["round"]
    rho, wd, lr = float(spec.momentum), float(spec.weight_decay), float(spec.lr)
    names = trained_names(model, spec.init)
    out = {k: v.detach().clone() for k, v in spec.init.items()}
    per = 3 if hf else 2

    grad_at = gradient(model, names, task)

    def decayed(g, w):  # torch SGD's weight_decay: g + ω·θ on the parameters θ the step moves
        return {k: g[k] + wd * w[k] for k in g} if wd else g

    for i, cid in enumerate(spec.clients):
        x_c, y_c = data.client(int(cid))
        steps = []  # the meta-steps' batches, pass after pass
        for p in range(passes):
            stream = spec.stream if p == 0 else spec.stream + SECOND
            batches = client_batches(len(x_c), spec, np_rng(seed, round, int(cid), stream), i)
            steps += [batches[per * t: per * t + per] for t in range(len(batches) // per)]
        factor = [r / lr for r in spec.step_rates(round, len(steps))] if lr else [1.0] * len(steps)
        w = {k: out[k][i] for k in out}
        buf = {k: torch.zeros_like(w[k]) for k in names}
        for t, group in enumerate(steps):
            a_t, b_t = alpha * factor[t], beta * factor[t]
            xs = [(x_c[torch.as_tensor(b, device=x_c.device)], y_c[torch.as_tensor(b, device=y_c.device)])
                  for b in group]
            g0 = decayed(grad_at(w, *xs[0]), w)
            for k in names:
                buf[k] = rho * buf[k] + g0[k]
            w_tilde = {k: w[k] - a_t * buf[k] if k in buf else w[k] for k in w}
            g = grad_at(w_tilde, *xs[1])
            if hf:
                plus = grad_at({k: w[k] + delta * g[k] if k in g else w[k] for k in w}, *xs[2])
                minus = grad_at({k: w[k] - delta * g[k] if k in g else w[k] for k in w}, *xs[2])
                g = {k: g[k] - a_t * (plus[k] - minus[k]) / (2 * delta) for k in g}
            g = decayed(g, w)
            for k in names:
                buf[k] = rho * buf[k] + g[k]
            w = {k: w[k] - b_t * buf[k] if k in buf else w[k] for k in w}
        for k in out:
            out[k][i] = w[k]
    calibrate_bn(model, out, data, spec.clients)  # each client's BN statistics under its w, as both trainers set them
    return out


class PerFedAvg(PersonalModels):
    unwritten_rows_are_global = False  # own_models computes the evaluation model (PersonalModels)
    name = "perfedavg"
    paper = ("Fallah, Mokhtari, Ozdaglar, Personalized Federated Learning with Theoretical Guarantees: A "
             "Model-Agnostic Meta-Learning Approach, NeurIPS 2020, arXiv 2002.07948")
    hyperparameters = (
        weighting("uniform", source="paper", note="w_{k+1} = (1/|A_k|) Σ_{A_k} w^i_{k+1,τ}"),
        choice("variant", "fo", ("fo", "hf", "pfllib"), "the update rule: fo (first order: the paper's Per-FedAvg "
               "(FO), the default of every code), hf (the paper's Hessian-free finite difference) or pfllib (FO as "
               "PFLlib runs it: α = β = train.lr, two local trainings a round)", source="code",
               note="MMorafah/PACFL client_per_fedavg.py (the thesis's), KarhouTam/FL-bench version=fo, "
                    "TsingZ0/PFLlib; the paper has both fo and hf; TsingZ0/PFLlib clientperavg.py (beta = the "
                    "learning rate) and serverperavg.py (client.train() twice a round): pfllib"),
        real("alpha", None, "adaptation step size, also of the evaluation's adaptation (default null = 1e-2: the "
             "PACFL thesis, FL-bench 1e-2; variant=pfllib: train.lr)", "α", ge=0, optional=True, source="thesis",
             note="the thesis's Per-FedAvg: α = 1e-2 (TsingZ0/PFLlib: the local lr)"),
        real("beta", None, "meta step size (default null = 1e-3: the PACFL thesis and FL-bench; variant=pfllib: "
             "train.lr)", "β", ge=0, optional=True, source="thesis",
             note="the thesis's Per-FedAvg: β = 1e-3 (FL-bench 1e-3; TsingZ0/PFLlib: the local lr)"),
        real("delta", 0.001, "finite-difference width of the HF variant (default 1e-3: FL-bench)", "δ", gt=0,
             source="code", note="KarhouTam/FL-bench perfedavg.py: δ = 1e-3 (the paper's δ: not verified)"),
        integer("adapt_steps", 1, "SGD steps at lr α on the client's training data before evaluation under "
                "eval_model=adapt (default 1: the paper; 0 = the global model)", "", ge=0, source="paper",
                note="evaluation after one stochastic-gradient step at α on the client's data"),
        choice("eval_model", "adapt", EVAL_MODELS, "the personal model evaluated: adapt (adapt_steps SGD steps at α "
               "on training batches), finetune (one epoch of full-model SGD at α on the training data) or "
               "last_local (the client's model after its last local training, kept per client; the global w for a "
               "client never trained)", "", source="paper",
               note="adapt: the paper's one step at α; finetune: KarhouTam/FL-bench finetune_epoch ≥ 1; "
                    "last_local: MMorafah/PACFL client_per_fedavg.py (the thesis's)"),
    )

    @property
    def keeps_rows(self) -> bool:
        """A per-client table only for ``last_local`` (the other personal models are w adapted at
        evaluation, never stored)."""
        return self.hp("eval_model") == "last_local"

    ALPHA, BETA = 0.01, 0.001  # the thesis's α and β (the defaults of fo and hf)

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        a = cfg.algorithm
        if getattr(a, "variant", "fo") == "pfllib":
            given = [k for k in ("alpha", "beta") if getattr(a, k, None) is not None]
            if given:
                raise ValueError(f"algorithm.{given[0]}: variant=pfllib sets α = β = train.lr (PFLlib's clientperavg.py); "
                                 f"drop algorithm.{given[0]}, or set variant=fo to choose α and β")
        mode, steps = getattr(a, "eval_model", "adapt"), getattr(a, "adapt_steps", 1)
        if mode != "adapt" and steps != 1:
            raise ValueError(f"algorithm.adapt_steps: {steps} adaptation steps only apply to eval_model=adapt "
                             f"(eval_model={mode} takes none); drop algorithm.adapt_steps or set eval_model=adapt")

    def alpha(self) -> float:
        """α: ``algorithm.alpha``, else the thesis's 1e-2 (variant=pfllib: ``train.lr``)."""
        a = self.hp("alpha")
        return float(a) if a is not None else self.cfg.train.lr if self.hp("variant") == "pfllib" else self.ALPHA

    def beta(self) -> float:
        """β: ``algorithm.beta``, else the thesis's 1e-3 (variant=pfllib: ``train.lr``)."""
        b = self.hp("beta")
        return float(b) if b is not None else self.cfg.train.lr if self.hp("variant") == "pfllib" else self.BETA

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        variant = self.hp("variant")
        spec.meta = {**spec.meta, "perfedavg": {"variant": "fo" if variant == "pfllib" else variant,
                                                "alpha": self.alpha(), "beta": self.beta(), "delta": self.hp("delta"),
                                                "passes": 2 if variant == "pfllib" else 1,
                                                "seed": ctx.seed, "round": round}}
        spec.solver = maml_solver
        return spec

    def own_models(self, state, ctx, clients, assign):
        """Each client's evaluation model (``eval_model``): w after ``adapt_steps`` steps, or one
        epoch, at lr α on its training batches; or its last local model (w if it never trained)."""
        clients = np.asarray(clients, np.int64)
        mode = self.hp("eval_model")
        if mode == "last_local":
            return super().own_models(state, ctx, clients, assign)
        glob = broadcast(state.models, len(clients))
        if mode == "finetune":
            spec = pass_spec(self.cfg.train, clients, glob, 1, stream="perfedavg_finetune")
        elif not self.hp("adapt_steps"):
            return glob
        else:
            spec = pass_spec(self.cfg.train, clients, glob, 1, steps=int(self.hp("adapt_steps")),
                             stream="perfedavg_adapt")
        return train_pass(ctx, dataclasses.replace(spec, lr=self.alpha()), state.round).params

    def new_rows(self, state, spec, result):
        """w: the mean of the trained clients' w^i (FedAvg's aggregate); under ``last_local``
        those w^i are their rows."""
        return {k: result.params[k] for k in state.models}

    def admit_newcomers(self, state, ctx, newcomers):
        rule = {"adapt": "the global w, adapted on own data (α-steps)",
                "finetune": "the global w, fine-tuned one epoch at α on own data",
                "last_local": "the global w (a newcomer has no last local model)"}[self.hp("eval_model")]
        return state, self.eval_assignment(state, ctx)[newcomers], rule
