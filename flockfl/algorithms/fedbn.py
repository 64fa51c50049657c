"""FedBN — Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", https://arxiv.org/abs/2102.07623.

Every BatchNorm layer stays local: its affine γ, β **and** its running statistics; every other
parameter goes through FedAvg. BN is found by module type (``bn`` partition of
:mod:`flockfl.algorithms.personal`), not by the 'bn' name substring the codes use. For the
``_bn`` models (``lenet5_bn``, ``cnn_bn``); a model without BN makes FedBN FedAvg. The
statistics are each client's own "precise BN" ones (``calibrate_bn`` after every local
training). Evaluation: the shared layers + the client's own BN.

``algorithm.local_norm`` (default ``bn``: the paper) says which normalisation layers stay local:
``bn`` the BatchNorm ones only (GroupNorm, LayerNorm and InstanceNorm are shared, averaged like
any other layer); ``all`` every normalisation layer found by module type (:func:`norm_layers`:
BatchNorm, InstanceNorm, GroupNorm, LayerNorm, RMSNorm), with whatever parameters and statistics
each has.

Weighting: uniform (the official code's 1/N, full participation). The local tensors never travel.
"""

from __future__ import annotations

from torch import nn

from flockfl.algorithms.hyper import choice, weighting
from flockfl.algorithms.partial import PartialSharing, resolve_layers
from models import WeightedBatchNorm2d

# every normalisation module type (``_NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm)
NORMS = tuple(t for t in (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, getattr(nn, "RMSNorm", None),
                          WeightedBatchNorm2d) if t is not None)


def norm_layers(model: nn.Module) -> list[str]:
    """The parameter names (statistics included where they are parameters) of every
    normalisation module of ``model``, in the model's order."""
    mods = [name for name, m in model.named_modules() if isinstance(m, NORMS)]
    return [n for n, _ in model.named_parameters() if any(n.startswith(m + ".") for m in mods)]


class FedBN(PartialSharing):
    name = "fedbn"
    paper = "Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, arXiv 2102.07623"
    hyperparameters = (
        weighting("uniform", source="code", note="med-air/FedBN fed_digits.py: client weights 1/N, full participation"),
        choice("local_norm", "bn", ("bn", "all"), "the normalisation layers that stay local: bn (BatchNorm only, found "
               "by module type; GroupNorm, LayerNorm and InstanceNorm are shared) or all (BatchNorm, InstanceNorm, "
               "GroupNorm, LayerNorm and RMSNorm stay local)", source="paper",
               note="FedBN keeps the BatchNorm layers local; med-air/FedBN, TsingZ0/PFLlib and KarhouTam/FL-bench "
                    "select them by the 'bn' name substring"),
    )

    @classmethod
    def split_key(cls, cfg) -> str:
        return f"algorithm.local_norm={cfg.algorithm.local_norm}"

    @classmethod
    def degenerate_fix(cls, cfg, missing: str) -> str:
        if missing == "personal":  # a model without (batch) normalisation layers
            return ("use a model with BatchNorm layers (model.name=lenet5_bn or cnn_bn), or algorithm.local_norm=all "
                    "for a model with other normalisation layers")
        return "use a model with shared layers besides its normalisation layers"

    def personal_names(self, model):
        if self.hp("local_norm") == "all":
            return norm_layers(model)
        return resolve_layers(model, "bn")
