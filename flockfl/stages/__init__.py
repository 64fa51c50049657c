"""Stages that compose with every algorithm: curricula (``curriculum``) and Sub-FedAvg
pruning (``pruning``). The round driver (``flockfl.rounds``) calls them around the
algorithm's hooks; neither is written into any algorithm."""

from flockfl.stages.curriculum import Curriculum
from flockfl.stages.pruning import Pruning

__all__ = ["Curriculum", "Pruning"]
