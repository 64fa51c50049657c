"""Algorithms, keyed by their registry name (``algorithm.name``)."""

from flockfl.algorithms.base import Algorithm, RunContext
from flockfl.algorithms.fedavg import FedAvg
from flockfl.algorithms.fedsgd import FedSGD
from flockfl.algorithms.ifca import IFCA

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedSGD, IFCA)}


def build_algorithm(cfg) -> Algorithm:
    return ALGORITHMS[cfg.algorithm.name](cfg)


__all__ = ["ALGORITHMS", "Algorithm", "RunContext", "build_algorithm"]
