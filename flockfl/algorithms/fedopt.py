"""FedOpt — Reddi et al., "Adaptive Federated Optimization", https://arxiv.org/abs/2003.00295.

Clients run plain local SGD. The server forms the mean model difference
Δ_t = (1/|S|) Σ (x_i − x_t) (the paper's sign; unweighted as in the paper,
``algorithm.weighting=samples`` for n_i weights) and applies an adaptive step:

    m_t = β1 m_{t−1} + (1 − β1) Δ_t
    FedAdagrad: v_t = v_{t−1} + Δ_t²
    FedYogi:    v_t = v_{t−1} − (1 − β2) Δ_t² ⊙ sign(v_{t−1} − Δ_t²)
    FedAdam:    v_t = β2 v_{t−1} + (1 − β2) Δ_t²
    x_{t+1} = x_t + η m_t / (√v_t + τ)          (no bias correction, as in the paper)

with v_{−1} = τ² (the paper's requirement v ≥ τ²) and m_{−1} = 0. Keys: ``server_lr`` η,
``beta1`` (0.9), ``beta2`` (0.99), ``tau`` (1e-3). η defaults to 0.01 for FedAdam and
FedYogi and 0.1 for FedAdagrad (Flower's defaults). Moments live in ``ServerState.algo``.
"""

from __future__ import annotations

import torch

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import real, weighting


class FedOpt(Algorithm):
    """The shared server step; subclasses give the second-moment rule."""

    paper = "Reddi et al., Adaptive Federated Optimization, arXiv 2003.00295"
    hyperparameters = (
        weighting("uniform"),
        real("server_lr", 0.01, "server learning rate", "η", gt=0),
        real("beta1", 0.9, "first-moment decay", "β₁", ge=0, lt=1),
        real("beta2", 0.99, "second-moment decay (FedAdam, FedYogi)", "β₂", gt=0, lt=1),
        real("tau", 1e-3, "adaptivity; v₋₁ = τ²", "τ", gt=0),
    )

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor, beta2: float) -> torch.Tensor:
        raise NotImplementedError

    def aggregate(self, state, ctx, spec, result, assign):
        lr, b1, b2, tau = (float(self.hp(k)) for k in ("server_lr", "beta1", "beta2", "tau"))
        delta = {k: -d for k, d in self.pseudo_gradient(state, result).items()}  # x_i − x, the paper's sign
        m_old = state.algo.get("m") or {k: torch.zeros_like(d) for k, d in delta.items()}
        v_old = state.algo.get("v") or {k: torch.full_like(d, tau * tau) for k, d in delta.items()}
        m = {k: b1 * m_old[k] + (1 - b1) * delta[k] for k in delta}
        v = {k: self.second_moment(v_old[k], delta[k] * delta[k], b2) for k in delta}
        models = {k: (x[0] + lr * m[k] / (v[k].sqrt() + tau)).unsqueeze(0) for k, x in state.models.items()}
        new = self._with_assignments(state, models, result.clients, assign)
        return new.replace(algo={**state.algo, "m": m, "v": v})


class FedAdagrad(FedOpt):
    name = "fedadagrad"
    hyperparameters = (real("server_lr", 0.1, "server learning rate", "η", gt=0),)

    def second_moment(self, v, d2, beta2):
        return v + d2


class FedAdam(FedOpt):
    name = "fedadam"

    def second_moment(self, v, d2, beta2):
        return beta2 * v + (1 - beta2) * d2


class FedYogi(FedOpt):
    name = "fedyogi"

    def second_moment(self, v, d2, beta2):
        return v - (1 - beta2) * d2 * torch.sign(v - d2)
