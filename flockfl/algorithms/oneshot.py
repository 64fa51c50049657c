"""The shared shape of methods that cluster clients once, before round 0 (PACFL, FLIS-HC).

The pre-federation step fixes ``state.assignments`` for the clients that federate and gives
every cluster its own copy of the initial model θ_g^0 (kept in ``state.algo['theta0']`` for
clusters that newcomers open later). Each round a sampled client downloads its cluster's
model, trains it, and the server averages each cluster with ``algorithm.weighting`` (FedAvg
inside each cluster, |D_k| weights). A cluster with no sampled member keeps its model.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.algorithms.base import Algorithm
from flockfl.context import RunContext
from flockfl.state import ServerState


class OneShotClustering(Algorithm):
    """FedAvg inside clusters that the pre-federation step fixed."""

    family = "clustered"

    def clustered_state(self, state: ServerState, ctx: RunContext, labels: np.ndarray, algo: dict) -> ServerState:
        """Every cluster starts from θ_g^0; the federating clients get their labels."""
        z = int(labels.max()) + 1 if len(labels) else 1
        theta0 = {k: v[0].clone() for k, v in state.models.items()}
        models = {k: v[:1].expand(z, *v.shape[1:]).clone() for k, v in state.models.items()}
        assignments = np.full(ctx.num_clients, -1, np.int64)
        assignments[ctx.seen] = labels
        return state.replace(models=models, assignments=assignments, algo={**state.algo, **algo, "theta0": theta0})

    def model_of(self, state, ctx, clients):
        return state.assignments[clients]

    def eval_assignment(self, state, ctx):
        return state.assignments

    def with_new_clusters(self, state: ServerState, count: int, start: dict | None = None) -> ServerState:
        """``count`` more cluster models, each a copy of ``start`` (default θ_g^0)."""
        if count == 0:
            return state
        start = start or state.algo["theta0"]
        models = {k: torch.cat([v, start[k].unsqueeze(0).expand(count, *v.shape[1:])]) for k, v in state.models.items()}
        return state.replace(models=models)
