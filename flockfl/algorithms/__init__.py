"""Algorithms, keyed by their registry name (``algorithm.name``)."""

from flockfl.algorithms.base import Algorithm, RunContext
from flockfl.algorithms.ccfl import CCFL
from flockfl.algorithms.fedavg import FedAvg
from flockfl.algorithms.fedavgm import FedAvgM
from flockfl.algorithms.fedeff import FedEff
from flockfl.algorithms.fednova import FedNova
from flockfl.algorithms.fedopt import FedAdagrad, FedAdam, FedYogi
from flockfl.algorithms.fedprox import FedProx
from flockfl.algorithms.fedsgd import FedSGD
from flockfl.algorithms.fedsplit import FedSplit
from flockfl.algorithms.ifca import IFCA
from flockfl.algorithms.scaffold import Scaffold

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (FedAvg, FedSGD, IFCA, FedProx, FedNova, Scaffold, FedAdam, FedAdagrad, FedYogi, FedAvgM, FedSplit, FedEff, CCFL)
}


def build_algorithm(cfg) -> Algorithm:
    return ALGORITHMS[cfg.algorithm.name](cfg)


__all__ = ["ALGORITHMS", "Algorithm", "RunContext", "build_algorithm"]
