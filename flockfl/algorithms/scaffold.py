"""SCAFFOLD — Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", https://arxiv.org/abs/1910.06378.

Server state: the model x and the control variate c; every client keeps its own c_i, which
persists across the rounds it sits out. All start at 0. A selected client runs K_i steps of
y ← y − η_l(g(y) − c_i + c), then updates its control variate:

- option II (``algorithm.option=II``, default, no extra pass): c_i⁺ = c_i − c + (x − y_i)/(K_i η_l);
- option I: c_i⁺ = ∇F_i(x), a full-batch gradient at the server model.

Server: Δx = mean(y_i − x), Δc = mean(c_i⁺ − c_i) (unweighted, as in the paper;
``algorithm.weighting=samples`` weights Δx by n_i), x ← x + η_g Δx, c ← c + (|S|/N) Δc.
``algorithm.server_lr`` η_g (default 1). c = mean_i(c_i) holds after every round.

The c_i live in a :class:`~flockfl.clientstate.ClientTable` (``state.algo['c_clients']``): a
round reads and writes only its cohort's rows, and a checkpoint writes only the rows that
changed, so 10,000 clients of a 159,010-weight MLP need the cohort's rows in memory, not 6.4 GB.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import broadcast
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, real, weighting
from flockfl.clientstate import ClientTable
from flockfl.engine import fused
from flockfl.engine.dense import LowRankWeight
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import train_cohort


class Scaffold(Algorithm):
    name = "scaffold"
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, arXiv 1910.06378"
    hyperparameters = (
        weighting("uniform"),
        choice("option", "II", ("II", "I"), "control-variate update: II (from the local steps) or I (a full gradient at x)"),
        real("server_lr", 1.0, "server learning rate", "η_g", gt=0),
        choice("momentum_correction", "after", ("after", "inside"),
               "with local momentum (train.momentum): the correction c − c_i added to each step after the momentum "
               "buffer, never accumulated (after: NIID-Bench's code) or added to the gradient inside the buffer "
               "(inside: amplified up to 1/(1 − ρ)); no effect without momentum", "", source="code",
               note="the paper's SCAFFOLD has no momentum; Xtra-Computing/NIID-Bench train_net_scaffold: SGD step "
                    "with momentum, then w ← w − lr·(c − c_i)"),
    )

    def init_state(self, ctx):
        state = super().init_state(ctx)
        zero = {k: torch.zeros_like(v[0]) for k, v in state.models.items()}
        return state.replace(algo={"c": zero, "c_clients": ClientTable(ctx.num_clients, zero)})

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        c_i = state.algo["c_clients"].gather(clients, ctx.data.train.x.device)
        spec.correction = {k: state.algo["c"][k].unsqueeze(0) - c_i[k] for k in state.models}
        # the cohort's c_i, read once: aggregate needs them again (in this process; never shipped)
        self._gathered = (state.algo["c_clients"], np.asarray(clients).copy(), c_i)
        spec.correction_after_momentum = self.hp("momentum_correction") == "after"
        return spec

    def __getstate__(self):  # the stash of _cohort_ci stays in this process (Dask ships the algorithm)
        return {k: v for k, v in self.__dict__.items() if k != "_gathered"}

    def _cohort_ci(self, state, clients, device) -> dict[str, torch.Tensor]:
        """The cohort's c_i as local_spec read them from this same table (a table is a value: the
        same object, the same rows), or read again (a resumed round, another process)."""
        kept, self._gathered = getattr(self, "_gathered", None), None
        if kept is not None and kept[0] is state.algo["c_clients"] and np.array_equal(kept[1], clients):
            return {k: v.to(device) for k, v in kept[2].items()}
        return state.algo["c_clients"].gather(clients, device)

    def full_gradient(self, state, ctx, clients: np.ndarray) -> dict[str, torch.Tensor]:
        """∇F_i(x) for every listed client: one full-batch step of size 1 from x."""
        x = broadcast(state.models, len(clients))
        res = train_cohort(ctx.model, LocalSpec(clients, x, 1.0, steps=1, full_batch=True), ctx.data.train,
                           ctx.data.task, ctx.seed, 0)
        return {k: x[k] - res.params[k] for k in x}

    def aggregate(self, state, ctx, spec, result, assign):
        clients = result.clients
        c = state.algo["c"]
        spec.correction = None  # trained: c − c_i is not needed again (a cohort-sized tensor less below)
        old = self._cohort_ci(state, clients, next(iter(c.values())).device)
        steps = torch.from_numpy(np.maximum(result.num_steps, 1).astype(np.float32)).to(next(iter(c.values())).device)
        grad_x = self.full_gradient(state, ctx, clients) if self.option == "I" else None
        step = self.pseudo_gradient(state, result)  # −Δx = mean(x − y_i)
        raw = result.raw_params  # a low-rank layer's y_i stay factors (flockfl/engine/dense.py)
        models, new_c, new_ci = {}, {}, {}
        for k, v in state.models.items():
            x = v[0]
            old_ci = old.pop(k)  # each c_i read is let go once used
            # cohort-sized temporaries reused in place, the operations and their order unchanged (the
            # same bits): 1,000 clients of a 159,010-weight MLP are 636 MB a tensor
            both = None  # (c_i⁺, c_i⁺ − c_i) in one pass (flockfl/engine/fused.py), the same bits
            factors = raw[k] if isinstance(raw[k], LowRankWeight) and raw[k].lr == self.cfg.train.lr else None
            y = None if factors is not None else result.params[k] if isinstance(raw[k], LowRankWeight) else raw[k]
            if grad_x is not None:
                ci = grad_x[k]
            elif factors is not None:
                # y_i = x − η·Σ_t g_t − η·K_i·(c − c_i), so option II's c_i − c + (x − y_i)/(K_i η) is the
                # mean of the client's own gradients, Σ_t g_t / K_i = D_iᵀA_i / K_i: read off the factors,
                # y_i never written out (a client that took no step keeps c_i − c, as the formula gives)
                ci = factors.gradient_sum(1.0 / steps)
                idle = torch.from_numpy(np.flatnonzero(result.num_steps == 0)).to(ci.device)
                if len(idle):
                    ci[idle] = old_ci[idle] - c[k].unsqueeze(0)
            else:
                scale = (1.0 / (steps * self.cfg.train.lr)).reshape(-1, *([1] * x.dim()))
                both = fused.scaffold_control(x, y, old_ci, c[k], scale)
                if both is None:
                    move = torch.sub(x.unsqueeze(0), y).mul_(scale)  # scale * (x − y_i)
                    ci = torch.sub(old_ci, c[k].unsqueeze(0)).add_(move)  # (c_i − c) + scale (x − y_i)
                    del move
            # c_i⁺ − c_i written over c_i, which nothing reads again (a − b is a + (−b): the same bits as a
            # new tensor; one cohort-sized tensor less at the round's peak, 636 MB for 1,000 clients)
            ci, diff = both if both is not None else (ci, torch.sub(ci, old_ci, out=old_ci))
            dc = diff.mean(0)
            del diff, both
            del old_ci
            models[k] = (x - float(self.hp("server_lr")) * step[k]).unsqueeze(0)
            new_c[k] = c[k] + (len(clients) / ctx.num_clients) * dc
            new_ci[k] = ci
        new = self._with_assignments(state, models, clients, assign)
        return new.replace(algo={**state.algo, "c": new_c, "c_clients": state.algo["c_clients"].scatter(clients, new_ci)})
