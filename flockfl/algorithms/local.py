"""Local training only (SOLO in the thesis's tables): every client trains its own model on its
own data and never communicates. The baseline a personalised or clustered method has to beat
(spec ``flis-pacfl-scniid.md`` §6).

Each client's model starts from the same θ_0; a sampled client trains E local epochs of SGD
on its model, which stays with it. With ``train.clients_per_round`` equal to the population,
every client trains every round. Evaluation uses each client's own model.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.algorithms.base import Algorithm


class Local(Algorithm):
    name = "local"
    paper = "local training only (SOLO), the thesis's non-federated baseline"
    family = "personalised"
    hyperparameters = ()

    def init_state(self, ctx):
        state = super().init_state(ctx)
        n = ctx.num_clients
        models = {k: v[:1].expand(n, *v.shape[1:]).clone() for k, v in state.models.items()}
        return state.replace(models=models, assignments=np.arange(n, dtype=np.int64))

    def model_of(self, state, ctx, clients):
        return np.asarray(clients, np.int64)

    def aggregate(self, state, ctx, spec, result, assign):
        idx = torch.from_numpy(np.asarray(result.clients, np.int64))
        models = {k: v.clone() for k, v in state.models.items()}
        for k in models:
            models[k][idx] = result.params[k]
        return self._with_assignments(state, models, result.clients, assign)

    def eval_assignment(self, state, ctx):
        return np.arange(ctx.num_clients, dtype=np.int64)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, np.asarray(newcomers, np.int64), "its own untrained model θ_0"

    def comm_bytes(self, state, clients):
        return 0, 0
