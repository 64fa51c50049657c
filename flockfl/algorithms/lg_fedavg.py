"""LG-FedAvg — Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", https://arxiv.org/abs/2001.01523.

Prediction is ŷ = g(ℓ_i(x; θ_i^l); θ^g): the local representation ℓ_i (the lower layers) stays
on the device, the upper layers g are global. Each round a sampled client loads θ^g, trains
(θ_i^l, θ^g) jointly for E epochs (``train.*``) and uploads θ_i^g; the server sets θ^g to the
mean of the uploads (``algorithm.weighting``, samples as PACFL's LG). No auxiliary local losses.

``algorithm.global_layers`` names the **global** part (the rest is local), default ``top:2``:
the PACFL thesis's LeNet-5 with fc2 + fc3 global and conv1, conv2, fc1 local ("3 local, 2
global"). ``top:3`` is the official MNIST MLP split, ``bottom:k`` FL-bench's, ``head`` PFLlib's;
``all`` is FedAvg and ``none`` local training (0 bytes).

**Warm start** (``algorithm.warm_start_rounds`` = W, default 0: the thesis's LG has none). The
official code starts LG from a FedAvg checkpoint (``best_400.pt`` of 1000 MNIST rounds): rounds
0..W−1 here are FedAvg on the whole model, bit for bit (every layer global, no client rows,
FedAvg's bytes and evaluation). At round W the client rows appear, every client's local layers
starting from the warm model's (as every official user loads the same checkpoint).

**Evaluation** (``algorithm.refresh_global_at_eval``):

- false (default, the thesis's code MMorafah/PACFL main_lg.py): each client is measured with
  its own current model, the (θ_i^l, θ_i^g) its last local training left it with; the global
  layers are stale for a client not sampled since, and a client never sampled has the init (or
  warm-start) model. The client rows then hold θ_i^g beside θ_i^l (in the
  :class:`~flockfl.clientstate.ClientTable`, only the cohort's read and written); training
  always loads the current θ^g, so the trained models do not depend on this key.
- true (the official pliang279/LG-FedAvg "written into all users' models"): every client with
  the current θ^g and its own θ_i^l.

``train.eval_finetune`` starts from the model the client is measured with; a newcomer gets the
current θ^g and the init (warm) local layers.

Not implemented: the official code's best-round-per-user evaluation (chosen on test data).
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import broadcast
from flockfl.algorithms.hyper import Hyper, integer, sourced, weighting
from flockfl.algorithms.partial import PartialSharing, partition_key
from flockfl.clientstate import ClientTable


class LGFedAvg(PartialSharing):
    name = "lg_fedavg"
    paper = ("Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, "
             "arXiv 2001.01523")
    hyperparameters = (
        weighting("samples", source="code", note="MMorafah/PACFL main_lg.py (the thesis's LG): n_i-weighted mean of "
                                                 "the global keys; the official pliang279/LG-FedAvg takes the uniform "
                                                 "mean"),
        sourced(partition_key("global_layers", "top:2", "the global layers g, averaged by the server; the others are "
                              "the local representation (default top:2: the PACFL thesis's LeNet-5 split, 3 local / "
                              "2 global)", "θ^g"),
                "thesis", "LeNet-5 with 3 local and 2 global layers, fc2 + fc3 (MMorafah/PACFL main_lg.py: the last 4 "
                          "state_dict keys); the official MNIST code: top:3"),
        integer("warm_start_rounds", 0, "rounds of FedAvg on the whole model before LG starts (every layer global; "
                "default 0: the thesis's LG has no warm start)", "W", ge=0, source="thesis",
                note="MMorafah/PACFL main_lg.py starts LG from the init; the official pliang279/LG-FedAvg warm-starts "
                     "from FedAvg (best_400.pt of 1000 MNIST rounds, best_1200.pt of 2000 CIFAR rounds)"),
        Hyper("refresh_global_at_eval", False, "evaluate every client with the current global layers θ^g (true), or "
              "with its own model as its last local training left it, stale θ_i^g included (default false: the "
              "thesis's code)", "", "bool", source="thesis",
              note="MMorafah/PACFL main_lg.py measures each client's own current model (unsampled clients keep "
                   "stale global layers); the official pliang279/LG-FedAvg writes θ^g into all users' models: true"),
    )
    layers_key = "global_layers"
    key_names_personal = False

    # ------------------------------------------------------------------ state
    def warm(self, state) -> bool:
        """A warm-start round: local layers exist but no client rows yet (so every layer is global)."""
        return bool(self.names(state)) and "personal" not in state.algo

    def stale(self, state) -> bool:
        """The client rows hold each client's last global layers (``refresh_global_at_eval`` false)."""
        return "personal" in state.algo and len(state.algo["personal"].names) > len(self.names(state))

    def with_rows(self, state, num_clients: int):
        """``state`` with the client rows: the local layers (and, measured stale, the global ones),
        every client's default row the server model's (the init, or the warm-start model)."""
        names = set(self.names(state))
        keys = [k for k in state.models if k in names or not self.hp("refresh_global_at_eval")]
        table = ClientTable(num_clients, {k: state.models[k][0] for k in keys})
        return state.replace(algo={**state.algo, "personal": table})

    def start_rows(self, state, ctx):
        """Round 0: the client rows, unless a warm start comes first (they appear at its end)."""
        if not self.names(state) or int(self.hp("warm_start_rounds")) > 0:
            return state
        return self.with_rows(state, ctx.num_clients)

    def before_training(self, state, ctx, clients, round):
        """The end of the warm start: the client rows appear, from the warm FedAvg model."""
        if self.warm(state) and round >= int(self.hp("warm_start_rounds")):
            return self.with_rows(state, ctx.num_clients)
        return state

    # ------------------------------------------------------------------ rounds
    def start_models(self, state, ctx, clients) -> dict[str, torch.Tensor]:
        """Where training starts: the current θ^g (broadcast) + each client's θ_i^l (warm: θ^g alone)."""
        clients = np.asarray(clients, np.int64)
        out = broadcast(state.models, len(clients))
        if "personal" in state.algo:
            rows = state.algo["personal"].gather(clients, next(iter(state.models.values())).device)
            out.update({k: rows[k] for k in self.names(state)})
        return out

    def kept_names(self, state) -> list[str]:
        """Warm: none (FedAvg on every layer). Then the local layers: PartialSharing's mean of the
        global layers, and the trained clients' rows (their θ_i^l, and measured stale their θ_i^g)."""
        return [] if self.warm(state) else self.names(state)

    # ------------------------------------------------------------------ evaluation
    def own_models(self, state, ctx, clients, assign):
        """The model a client is measured (and fine-tuned) with: stale, its row as its last local
        training left it (the init or warm model if never sampled; a newcomer: the current θ^g
        and the init local layers); refreshed, the current θ^g + its θ_i^l."""
        if not self.stale(state):
            return self.start_models(state, ctx, clients)
        clients = np.asarray(clients, np.int64)
        device = next(iter(state.models.values())).device
        rows = state.algo["personal"].gather(clients, device)
        new = np.isin(clients, ctx.unseen)
        if new.any():
            pick = torch.from_numpy(new).to(device)
            names = set(self.names(state))
            for k, v in state.models.items():
                if k not in names:
                    rows[k] = torch.where(pick.reshape(-1, *[1] * (v.dim() - 1)), v[:1].expand_as(rows[k]), rows[k])
        return rows
