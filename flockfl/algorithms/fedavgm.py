"""FedAvgM — Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", https://arxiv.org/abs/1909.06335.

Server momentum on the sample-weighted pseudo-gradient Δ̄_t = Σ p̃_i (x_t − x_i):

- ``momentum_style=heavy_ball`` (default, as Flower and TFF): v_t = β v_{t−1} + Δ̄_t, x ← x − η_s v_t;
- ``momentum_style=ema`` (CC-FL's form): m_t = (1 − β) Δ̄_t + β m_{t−1}, x ← x − η_s m_t.

``algorithm.momentum`` β (default 0.9), ``algorithm.server_lr`` η_s (default 1). β = 0 with
η_s = 1 is FedAvg. The buffer lives in ``ServerState.algo['velocity']``.
"""

import torch

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, real


class FedAvgM(Algorithm):
    name = "fedavgm"
    paper = "Hsu, Qi, Brown, Measuring the Effects of Non-Identical Data Distribution, arXiv 1909.06335"
    hyperparameters = (
        real("momentum", 0.9, "server momentum", "β", ge=0, lt=1),
        real("server_lr", 1.0, "server learning rate", "η_s", gt=0),
        choice("momentum_style", "heavy_ball", ("heavy_ball", "ema"), "v = βv + Δ (heavy_ball) or m = (1−β)Δ + βm (ema)"),
    )

    def aggregate(self, state, ctx, spec, result, assign):
        beta, lr = float(self.hp("momentum")), float(self.hp("server_lr"))
        delta = self.pseudo_gradient(state, result)
        old = state.algo.get("velocity") or {k: torch.zeros_like(d) for k, d in delta.items()}
        if self.cfg.algorithm.momentum_style == "ema":
            vel = {k: (1 - beta) * delta[k] + beta * old[k] for k in delta}
        else:
            vel = {k: beta * old[k] + delta[k] for k in delta}
        models = {k: (v[0] - lr * vel[k]).unsqueeze(0) for k, v in state.models.items()}
        new = self._with_assignments(state, models, result.clients, assign)
        return new.replace(algo={**state.algo, "velocity": vel})
