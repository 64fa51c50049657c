"""RunContext: what every hook and stage may read (the config, the model template, the
client data and the simulated system), the same for every round of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from torch import nn

from flockfl.config import ExperimentConfig
from flockfl.engine.data import ClientData
from flockfl.rng import np_rng
from flockfl.system import SystemProfile, make_profile


@dataclass
class RunContext:
    """What every hook may read: the config, the model template and the client data."""

    cfg: ExperimentConfig
    model: nn.Module
    data: ClientData
    truth: dict = field(default_factory=dict)  # ground truth known to the generator (e.g. θ*)
    system: Optional[SystemProfile] = None  # simulated client speeds; drawn from cfg.system if not given
    # files the algorithm's config names, read by the run's preparation (``Algorithm.input_files``,
    # ``flockfl.rounds.read_inputs``): an algorithm never opens a file itself
    inputs: dict = field(default_factory=dict)
    # clients that federate, and the newcomers (partition.unseen_fraction) that join afterwards
    seen: np.ndarray = field(init=False)
    unseen: np.ndarray = field(init=False)
    # the data as partitioned; ``data`` is the current view, which a distribution shift
    # (``shift.*``, flockfl/stages/shift.py) changes from round to round
    base_data: ClientData = field(init=False)
    data_version: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.base_data = self.data
        if self.system is None:
            self.system = make_profile(self.cfg.system, self.cfg.seed, self.data.num_clients)
        self.unseen = unseen_clients(self.data.num_clients, self.cfg.partition.unseen_fraction, self.cfg.seed)
        self.seen = np.setdiff1d(np.arange(self.data.num_clients), self.unseen)

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def num_clients(self) -> int:
        return self.data.num_clients


def unseen_clients(n: int, fraction: float, seed: int) -> np.ndarray:
    """round(fraction·n) clients, drawn from the (seed, "unseen") stream, that never train."""
    count = int(round(fraction * n))
    if count == 0:
        return np.zeros(0, np.int64)
    return np.sort(np_rng(seed, purpose="unseen").choice(n, size=count, replace=False)).astype(np.int64)
