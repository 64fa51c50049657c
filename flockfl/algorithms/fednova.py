"""FedNova — Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", https://arxiv.org/abs/2007.07481 (code: JYWa/FedNova).

A client that takes τ_i local steps moves by Δ_i = x_t − x_i = η_l G_i a_i. The server averages
the normalised directions and rescales them by an effective step count:

    x_{t+1} = x_t − τ_eff Σ_i p_i Δ_i / ‖a_i‖₁,    τ_eff = Σ_i p_i ‖a_i‖₁,

with p_i = n_i / Σ_{j∈S_t} n_j and ‖a_i‖₁ from the local optimiser:
plain SGD τ_i; heavy-ball momentum ρ (``algorithm.momentum``)
[τ_i − ρ(1 − ρ^τ_i)/(1 − ρ)]/(1 − ρ); proximal SGD with α = η_l μ (``algorithm.mu``)
[1 − (1 − α)^τ_i]/α. Local momentum buffers start at zero every round. Heterogeneous τ_i
come from unequal data sizes or ``train.local_work=uniform_random``. With equal τ_i and plain
SGD this is FedAvg.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import real


def a_norm(tau: np.ndarray, momentum: float = 0.0, alpha: float = 0.0) -> np.ndarray:
    """‖a_i‖₁ for τ_i local steps of plain, momentum or proximal SGD."""
    tau = np.asarray(tau, dtype=np.float64)
    if momentum:
        r = momentum
        return (tau - r * (1 - r ** tau) / (1 - r)) / (1 - r)
    if alpha:
        return (1 - (1 - alpha) ** tau) / alpha
    return tau


class FedNova(Algorithm):
    name = "fednova"
    paper = "Wang et al., Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization, arXiv 2007.07481"
    hyperparameters = (
        real("momentum", 0.0, "local heavy-ball momentum (normalised by its ‖a_i‖₁)", "ρ", ge=0, lt=1),
        real("mu", 0.0, "local proximal weight (normalised by its ‖a_i‖₁)", "μ", ge=0),
    )

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.algorithm.momentum > 0 and cfg.algorithm.mu > 0:
            raise ValueError("algorithm.momentum and algorithm.mu: FedNova normalises one local optimiser; set only one of them")

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        spec.momentum, spec.prox_mu = float(self.hp("momentum")), float(self.hp("mu"))
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        p = self.weights(result, np.arange(len(result.clients))).double()
        a = torch.from_numpy(a_norm(result.num_steps, float(self.hp("momentum")), self.cfg.train.lr * float(self.hp("mu")))).to(p.device)
        a = a.clamp_min(1e-12)  # a client that took no step contributes Δ = 0
        tau_eff = float((p * a).sum())
        coef = (tau_eff * p / a).to(torch.float32)  # per-client factor on Δ_i
        step = weighted_mean({k: v[0].unsqueeze(0) - result.params[k] for k, v in state.models.items()}, coef)
        models = {k: (v[0] - step[k]).unsqueeze(0) for k, v in state.models.items()}
        return self._with_assignments(state, models, result.clients, assign)
