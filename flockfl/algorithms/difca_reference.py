"""DIFCA's reference-code variants (``algorithm.dfca_variant``): the algorithm of the later
reference code jonaskir6/dfca ("DFCA") instead of the seed's (Kirch 2024; ``difca.py``).

``reference_gi`` / ``reference_li``: every client keeps **all k models** locally, chooses by
argmin loss over its own copies and trains its copy. Gossip is not restricted to a cluster:
client i draws r_i ~ U{1, …, h−1} partners among all other participants, h = min(|M| − 1,
50 if |M| > 800 else 15) (no gossip when h ≤ 1). Processing the clients in order, an exchange of
i with j (clusters c_i, c_j; α = 0.5 if c_i = c_j, else 0.4) sets
θ_{i,c_j} ← αθ_{i,c_j} + (1−α)θ_{j,c_j}, then θ_{j,c_i} ← αθ_{j,c_i} + (1−α)θ_{i,c_i} (in that
order, with the updated θ_{i,c_i} when c_i = c_j, as the reference code does), and counts against
j's draw too: j's list loses i if it holds i, else a random entry, and a peer whose list is
already empty leaves every list (:func:`flockfl.clustering.gossip.reference_gossip`). ``gi``
("global init") gives every client the same k initial models; ``li`` ("local init") draws each
client's k models independently (streams (seed, client, "difca/li/<j>")), so the server
publishes none. Tokens and representatives work as in the seed's variant (the holder's copy of
its cluster's model); evaluation and fine-tuning use each client's own copies. ``partners``,
``gossip`` and ``gossip_weighting`` do not apply.

Memory: the copies live in ``state.algo['client_models']``, N × k × P floats for N clients and P
parameters (e.g. 48 × 4 × 159 010 float32 ≈ 122 MB for the MNIST MLP 784-200-10); the seed's
variant keeps no copies (k representatives only). Random stream of the exchange: (seed, round,
"difca/reference_partners").

DIFCA picks a :class:`ClientCopies` once, in ``__init__`` (:func:`client_copies`), and hands it
the variant's steps.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from flockfl.aggregation import flatten, unflatten
from flockfl.algorithms.model_choice import confidence_scores
from flockfl.clustering.gossip import reference_gossip
from flockfl.context import RunContext
from flockfl.engine.functional import stack
from flockfl.engine.trainers import TrainResult
from flockfl.evaluation import client_model_losses
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState

REFERENCE = ("reference_gi", "reference_li")


class ClientCopies:
    """The reference variants' client side: every client's own copies of the k models,
    ``state.algo['client_models']`` ([N, k, ...])."""

    def __init__(self, variant: str):
        self.variant = variant

    @property
    def shared_init(self) -> bool:
        """gi: the copies start from the server's k models (which the server publishes); li: each client draws its own."""
        return self.variant == "reference_gi"

    def initial(self, state: ServerState, ctx: RunContext, k: int,
                draw: Callable[[RunContext, torch.Generator], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Round 0's copies: the server's models for every client (gi), or k per client, each from
        its own stream (li); ``draw`` is the algorithm's random model."""
        if self.shared_init:
            return self.broadcast(state, ctx)
        local = stack([stack([draw(ctx, torch_generator(ctx.seed, client=i, purpose=f"difca/li/{j}")) for j in range(k)])
                       for i in range(ctx.num_clients)])
        device = next(iter(state.models.values())).device
        return {name: v.to(device) for name, v in local.items()}

    def broadcast(self, state: ServerState, ctx: RunContext) -> dict[str, torch.Tensor]:
        """Every client's copies set to the server's k models."""
        return {name: v.unsqueeze(0).expand(ctx.num_clients, *v.shape).clone() for name, v in state.models.items()}

    def after_pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """gi: every client's copies start from the k models IFCA's pre-federation step produced
        (``init=pretrain_kmeans`` only: DIFCA's default start has no such step)."""
        if not self.shared_init:
            return state
        return state.replace(algo={**state.algo, "client_models": self.broadcast(state, ctx)})

    def own(self, state: ServerState, clients: np.ndarray, which: np.ndarray) -> dict[str, torch.Tensor]:
        """Client ``clients[i]``'s own copy of model ``which[i]``, stacked."""
        cm = state.algo["client_models"]
        device = next(iter(cm.values())).device
        idx = torch.from_numpy(np.asarray(clients, np.int64)).to(device)
        col = torch.from_numpy(np.asarray(which, np.int64)).to(device)
        return {k: v[idx, col] for k, v in cm.items()}

    def losses(self, state: ServerState, ctx: RunContext, clients: np.ndarray, k: int) -> torch.Tensor:
        """[k, C] training loss of every listed client under each of its own k copies."""
        cm = state.algo["client_models"]
        cols = [client_model_losses(ctx.model, {n: v[int(c)] for n, v in cm.items()}, ctx.data.train,
                                    np.array([c]), ctx.data.task)[0] for c in clients]
        return torch.cat(cols, 1) if cols else torch.zeros(k, 0)

    def confidences(self, state: ServerState, ctx: RunContext, clients: np.ndarray, k: int) -> torch.Tensor:
        """[k, C] confidence of every listed client under each of its own k copies."""
        cm = state.algo["client_models"]
        cols = [confidence_scores(ctx.model, {n: v[int(c)] for n, v in cm.items()}, ctx.data, np.array([c]))
                for c in clients]
        return torch.cat(cols, 1) if cols else torch.zeros(k, 0)

    def gossip_round(self, state: ServerState, ctx: RunContext, result: TrainResult, assign: np.ndarray, round: int
                     ) -> tuple[dict[str, torch.Tensor], int]:
        """(the new copies, the number of exchanges): the trained copies go back into every
        participant's k models, then the reference gossip runs over all participants."""
        cm = state.algo["client_models"]
        device = next(iter(cm.values())).device
        clients = np.asarray(result.clients, np.int64)
        idx = torch.from_numpy(clients).to(device)
        col = torch.from_numpy(np.asarray(assign, np.int64)).to(device)
        mine = {name: v[idx] for name, v in cm.items()}  # the participants' k copies
        flat = flatten(mine, lead=2)  # [m, k, P], a fresh tensor
        flat[torch.arange(len(clients), device=device), col] = flatten({n: result.params[n] for n in cm}).to(flat)
        rng = np_rng(ctx.seed, round, purpose="difca/reference_partners")
        exchanges = reference_gossip(flat, np.asarray(assign, np.int64), rng)
        mixed = unflatten(flat, mine, lead=2)
        new_cm = {name: v.clone() for name, v in cm.items()}
        for name in new_cm:
            new_cm[name][idx] = mixed[name]
        return new_cm, exchanges


def client_copies(variant: str) -> Optional[ClientCopies]:
    """The variant's client copies (None for the seed's algorithm, ``dfca_variant=none``)."""
    return ClientCopies(variant) if variant in REFERENCE else None
