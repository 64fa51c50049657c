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
loop that both trainers call, so they agree trivially. Plain SGD (no momentum: the paper's;
PACFL's momentum 0.5 shared across the α- and β-steps is not reproduced; ``train.momentum`` is
ignored). α = 0 is FedAvg at lr β on the D' batches.

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

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.aggregation import broadcast
from flockfl.algorithms.personal import PersonalModels, gradient, run_pass, trained_names
from flockfl.client import pass_spec
from flockfl.engine.schedule import client_batches
from flockfl.engine.trainers import calibrate_bn
from flockfl.rng import np_rng


EVAL_MODELS = ("adapt", "finetune", "last_local")


def maml_solver(model, spec, data, task) -> dict[str, torch.Tensor]:
    """Per-FedAvg's local meta-steps for every client of ``spec`` (``spec.meta['perfedavg']``:
    variant, alpha, beta, delta, seed, round)."""
    m = spec.meta["perfedavg"]
    alpha, beta, delta, hf = float(m["alpha"]), float(m["beta"]), float(m["delta"]), m["variant"] == "hf"
    names = trained_names(model, spec.init)
    out = {k: v.detach().clone() for k, v in spec.init.items()}

    grad_at = gradient(model, names, task)

    for i, cid in enumerate(spec.clients):
        x_c, y_c = data.client(int(cid))
        batches = client_batches(len(x_c), spec, np_rng(m["seed"], m["round"], int(cid), spec.stream), i)
        per = 3 if hf else 2
        w = {k: out[k][i] for k in out}
        for t in range(len(batches) // per):
            xs = [(x_c[torch.as_tensor(b, device=x_c.device)], y_c[torch.as_tensor(b, device=y_c.device)])
                  for b in batches[per * t: per * t + per]]
            g0 = grad_at(w, *xs[0])
            w_tilde = {k: w[k] - alpha * g0[k] if k in g0 else w[k] for k in w}
            g = grad_at(w_tilde, *xs[1])
            if hf:
                plus = grad_at({k: w[k] + delta * g[k] if k in g else w[k] for k in w}, *xs[2])
                minus = grad_at({k: w[k] - delta * g[k] if k in g else w[k] for k in w}, *xs[2])
                g = {k: g[k] - alpha * (plus[k] - minus[k]) / (2 * delta) for k in g}
            w = {k: w[k] - beta * g[k] if k in g else w[k] for k in w}
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
        choice("variant", "fo", ("fo", "hf"), "meta-gradient: fo (first order: the paper's Per-FedAvg (FO), the "
               "default of every code) or hf (the paper's Hessian-free finite difference)", source="code",
               note="MMorafah/PACFL client_per_fedavg.py (the thesis's), KarhouTam/FL-bench version=fo, "
                    "TsingZ0/PFLlib; the paper has both"),
        real("alpha", 0.01, "adaptation step size, also of the evaluation's adaptation (default 1e-2: the PACFL "
             "thesis; FL-bench 1e-2)", "α", ge=0, source="thesis", note="the thesis's Per-FedAvg: α = 1e-2"),
        real("beta", 0.001, "meta step size (default 1e-3: the PACFL thesis and FL-bench)", "β", ge=0, source="thesis",
             note="the thesis's Per-FedAvg: β = 1e-3 (FL-bench 1e-3)"),
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

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        a = cfg.algorithm
        mode, steps = getattr(a, "eval_model", "adapt"), getattr(a, "adapt_steps", 1)
        if mode != "adapt" and steps != 1:
            raise ValueError(f"algorithm.adapt_steps: {steps} adaptation steps only apply to eval_model=adapt "
                             f"(eval_model={mode} takes none); drop algorithm.adapt_steps or set eval_model=adapt")

    def local_spec(self, state, ctx, clients, round):
        spec = Algorithm.local_spec(self, state, ctx, clients, round)
        spec.meta = {**spec.meta, "perfedavg": {"variant": self.hp("variant"), "alpha": self.hp("alpha"),
                                                "beta": self.hp("beta"), "delta": self.hp("delta"),
                                                "seed": ctx.seed, "round": round}}
        spec.solver = maml_solver
        return spec

    def own_models(self, state, ctx, clients, assign):
        """Each client's evaluation model (``eval_model``): w after ``adapt_steps`` steps, or one
        epoch, at lr α on its training batches; or its last local model (w if it never trained)."""
        clients = np.asarray(clients, np.int64)
        mode = self.hp("eval_model")
        if mode == "last_local":
            return PersonalModels.own_models(self, state, ctx, clients, assign)
        glob = broadcast(state.models, len(clients))
        if mode == "finetune":
            spec = pass_spec(self.cfg.train, clients, glob, 1, stream="perfedavg_finetune")
        elif not self.hp("adapt_steps"):
            return glob
        else:
            spec = pass_spec(self.cfg.train, clients, glob, 1, steps=int(self.hp("adapt_steps")),
                             stream="perfedavg_adapt")
        return run_pass(ctx, state, dataclasses.replace(spec, lr=float(self.hp("alpha"))), state.round).params

    def aggregate(self, state, ctx, spec, result, assign):
        """w: the mean of the trained clients' w^i; under ``last_local`` those w^i to their rows."""
        new = Algorithm.aggregate(self, state, ctx, spec, result, assign)
        if not self.keeps_rows:
            return new
        rows = {k: result.params[k] for k in state.models}
        return new.replace(algo={**state.algo, "personal": state.algo["personal"].scatter(result.clients, rows)})

    def admit_newcomers(self, state, ctx, newcomers):
        rule = {"adapt": "the global w, adapted on own data (α-steps)",
                "finetune": "the global w, fine-tuned one epoch at α on own data",
                "last_local": "the global w (a newcomer has no last local model)"}[self.hp("eval_model")]
        return state, self.eval_assignment(state, ctx)[newcomers], rule
