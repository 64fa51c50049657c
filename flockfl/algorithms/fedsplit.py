"""FedSplit — Pathak & Wainwright, "FedSplit: an algorithmic framework for fast federated
optimization", https://arxiv.org/abs/2005.05238 (Peaceman–Rachford splitting).

Every client j keeps z_j (all start at x). A selected client computes

    z_j^{t+½} = prox_{s f_j}(2x − z_j)      (local prox step)
    z_j^{t+1} = z_j + 2 (z_j^{t+½} − x)     (centering)

and the server sets x ← mean of **all m** z_j (clients that sat out keep their stale z_j,
which keeps the fixed point; averaging only the returned ones would move it).

The prox (``algorithm.prox``):
- ``gd`` (default): ``train.local_steps``/epochs of (S)GD on f_j(u) + ‖u − v‖²/(2s), started at
  the broadcast x (this warm start keeps the exact fixed point for any number of steps);
- ``exact``: the closed form for linear least squares, f_j(u) = (1/n_j)‖A_j u − b_j‖²:
  u = ((2/n_j) A_jᵀA_j + I/s)⁻¹ ((2/n_j) A_jᵀ b_j + v/s), solved in float64.

``algorithm.s`` is the prox step s (default 0.1; s = 1/√(ℓL) is the paper's choice when the
constants are known). The z_j live in ``ServerState.algo['z']``.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, real


def exact_lsq_prox(model, spec, data, task) -> dict[str, torch.Tensor]:
    """A local solver: u_j = prox_{s f_j}(v_j) in closed form for the bias-free linear model,
    with v_j = ``spec.prox_anchor`` and 1/s = ``spec.prox_mu`` (so shards slice them along)."""
    (name,) = spec.prox_anchor  # the linear model has a single weight [1, d]
    v, inv_s = spec.prox_anchor[name], spec.prox_mu
    out = []
    for i, c in enumerate(spec.clients):
        a, b = data.client(int(c))
        a, b = a.reshape(len(a), -1).double(), b.double()
        n, d = a.shape
        lhs = (2.0 / max(n, 1)) * a.T @ a + inv_s * torch.eye(d, dtype=torch.float64)
        rhs = (2.0 / max(n, 1)) * a.T @ b + inv_s * v[i].reshape(-1).double()
        out.append(torch.linalg.solve(lhs, rhs).to(torch.float32).reshape(v[i].shape))
    return {name: torch.stack(out)}


class FedSplit(Algorithm):
    name = "fedsplit"
    paper = "Pathak, Wainwright, FedSplit: an algorithmic framework for fast federated optimization, arXiv 2005.05238"
    hyperparameters = (
        real("s", 0.1, "prox step size", "s", gt=0),
        choice("prox", "gd", ("gd", "exact"), "prox solver: warm-started (S)GD, or exact (linear least squares only)"),
    )

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.algorithm.prox == "exact" and cfg.model.name != "linear":
            raise ValueError("algorithm.prox: 'exact' is the closed-form prox of linear least squares; use model.name=linear or prox=gd")

    def init_state(self, ctx):
        state = super().init_state(ctx)
        z = {k: v[:1].expand(ctx.num_clients, *v.shape[1:]).clone() for k, v in state.models.items()}
        return state.replace(algo={"z": z})

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)  # warm start at the broadcast x
        idx = torch.from_numpy(np.asarray(clients))
        s = float(self.hp("s"))
        v = {k: 2 * x[:1] - state.algo["z"][k][idx] for k, x in state.models.items()}  # 2x − z_j
        spec.prox_mu, spec.prox_anchor = 1.0 / s, v
        if self.cfg.algorithm.prox == "exact":
            spec.solver = exact_lsq_prox
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        idx = torch.from_numpy(np.asarray(result.clients))
        models, z = {}, {}
        for k, x in state.models.items():
            z[k] = state.algo["z"][k].clone()
            z[k][idx] = z[k][idx] + 2 * (result.params[k] - x[:1])  # centering
            models[k] = z[k].mean(0, keepdim=True)  # all m z_j, stale ones included
        new = self._with_assignments(state, models, result.clients, assign)
        return new.replace(algo={**state.algo, "z": z})
