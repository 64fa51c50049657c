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

Not implemented: the official code's FedAvg warm start and its best-round-per-user evaluation;
evaluation uses the current θ^g for every client (the official "average put back" rule), not
the stale θ^g an unsampled client last saw (PACFL).
"""

from __future__ import annotations

from flockfl.algorithms.hyper import sourced, weighting
from flockfl.algorithms.personal import PartialSharing, partition_key


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
    )
    layers_key = "global_layers"
    key_names_personal = False
