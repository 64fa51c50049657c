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

Evaluation: ``accuracy`` (= ``accuracy_personal``) is w after ``adapt_steps`` (default 1, the
paper) SGD steps at lr α on the client's *training* batches (size B, stream (seed, round,
client, ``perfedavg_adapt``)), run by the run's trainer; ``accuracy_global`` is w. No per-client
state. Newcomers adapt the same way (``train.finetune_epochs`` epochs of SGD from the adapted w).
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
from flockfl.rng import np_rng


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
    return out


class PerFedAvg(PersonalModels):
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
        integer("adapt_steps", 1, "SGD steps at lr α on the client's training data before evaluation (default 1: "
                "the paper; 0 = the global model)", "", ge=0, source="paper",
                note="evaluation after one stochastic-gradient step at α on the client's data"),
    )
    keeps_rows = False  # the personal model is w adapted at evaluation, never stored

    def local_spec(self, state, ctx, clients, round):
        spec = Algorithm.local_spec(self, state, ctx, clients, round)
        spec.meta = {**spec.meta, "perfedavg": {"variant": self.hp("variant"), "alpha": self.hp("alpha"),
                                                "beta": self.hp("beta"), "delta": self.hp("delta"),
                                                "seed": ctx.seed, "round": round}}
        spec.solver = maml_solver
        return spec

    def own_models(self, state, ctx, clients, assign):
        """w after ``adapt_steps`` steps at lr α on each client's training batches."""
        clients = np.asarray(clients, np.int64)
        glob = broadcast(state.models, len(clients))
        if not self.hp("adapt_steps"):
            return glob
        spec = pass_spec(self.cfg.train, clients, glob, 1, steps=int(self.hp("adapt_steps")), stream="perfedavg_adapt")
        return run_pass(ctx, state, dataclasses.replace(spec, lr=float(self.hp("alpha"))), state.round).params

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global w, adapted on own data (α-steps)"
