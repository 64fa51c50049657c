"""FedPer — Arivazhagan et al., "Federated Learning with Personalization Layers",
https://arxiv.org/abs/1912.00818.

The base layers W_B are shared by FedAvg; the last K_P "personalisation layers" W_P stay on the
client. Each round a selected client loads the current W_B and its own W_P, trains [W_B, W_P]
**jointly** for E epochs of SGD (``train.*``), and uploads W_B only; the server averages the
W_B sample-weighted. A client's W_P starts from the seeded init of the model. Evaluation: the
current W_B + the client's own W_P, without fine-tuning.

``algorithm.personal_layers`` (default ``head``, K_P = 1, as PFLlib's FedPer: the paper's K_P
values could not be verified and it has no official code) takes any partition of
:mod:`flockfl.algorithms.personal` (``top:2`` = K_P 2, prefixes, ``none`` = FedAvg).
"""

from __future__ import annotations

from flockfl.algorithms.hyper import sourced, weighting
from flockfl.algorithms.partial import PartialSharing, partition_key

class FedPer(PartialSharing):
    name = "fedper"
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818"
    hyperparameters = (
        weighting("samples", source="paper", note="the server averages the base layers W_B as FedAvg, n_i-weighted "
                                                  "(also TsingZ0/PFLlib)"),
        sourced(partition_key("personal_layers", "head", "the personalisation layers kept on each client (default "
                              "head, K_P = 1: PFLlib's code; the paper's K_P is unverified)", "W_P"),
                "code", "TsingZ0/PFLlib clientper.py: W_P = the head (no official code; the paper's K_P: not "
                        "verified)"),
    )
