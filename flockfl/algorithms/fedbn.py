"""FedBN — Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", https://arxiv.org/abs/2102.07623.

Every BatchNorm layer stays local: its affine γ, β **and** its running statistics; every other
parameter goes through FedAvg. BN is found by module type (``bn`` partition of
:mod:`flockfl.algorithms.personal`), not by the 'bn' name substring the codes use. For the
``_bn`` models (``lenet5_bn``, ``cnn_bn``); a model without BN makes FedBN FedAvg. The
statistics are each client's own "precise BN" ones (``calibrate_bn`` after every local
training). Evaluation: the shared layers + the client's own BN.

Weighting: uniform (the official code's 1/N, full participation). BN tensors never travel.
"""

from __future__ import annotations

from flockfl.algorithms.hyper import weighting
from flockfl.algorithms.personal import PartialSharing


class FedBN(PartialSharing):
    name = "fedbn"
    paper = "Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, arXiv 2102.07623"
    hyperparameters = (weighting("uniform", source="code", note="med-air/FedBN fed_digits.py: client weights 1/N, full "
                                                                "participation"),)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Nothing to check: the partition is always ``bn``."""

    def personal_names(self, model):
        from flockfl.algorithms.personal import resolve_layers

        return resolve_layers(model, "bn")
