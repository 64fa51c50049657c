"""RunContext: what every hook and stage may read (the config, the model template, the
client data, the simulated system and the run's trainer). The config, model, system and trainer
stay the same for a whole run; ``data`` is the current view of the clients' data, which a
distribution shift changes from round to round (``base_data`` is the data as partitioned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from torch import nn

from flockfl.config import ExperimentConfig
from flockfl.engine import TRAINERS, TrainResult
from flockfl.engine.data import ClientData
from flockfl.rng import np_rng
from flockfl.system import SystemProfile, make_profile


@dataclass
class RunContext:
    """What every hook may read: the config, the model template, the client data and the trainer."""

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
    # the trainer this run uses (``train.engine``, or what ``auto`` chose on the first cohort),
    # set by the driver (``flockfl.rounds.pick_engine``, from the state on resume); read it as ``trainer``
    engine: Optional[str] = field(init=False, default=None)
    # the stored per-client metrics the running evaluation reuses (``eval.reuse``,
    # :mod:`flockfl.eval_reuse`): set by the driver's evaluation only, None elsewhere
    eval_reuse: Optional[Any] = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.base_data = self.data
        if self.system is None:
            self.system = make_profile(self.cfg.system, self.cfg.seed, self.data.num_clients)
        self.unseen = unseen_clients(self.data.num_clients, self.cfg.partition.unseen_fraction, self.cfg.seed)
        self.seen = np.setdiff1d(np.arange(self.data.num_clients), self.unseen)

    @property
    def engine_name(self) -> str:
        """The engine the driver chose, or the configured one before any round has chosen (``auto`` → vectorized)."""
        return self.engine or ("vectorized" if self.cfg.train.engine == "auto" else self.cfg.train.engine)

    @property
    def trainer(self) -> Callable[..., TrainResult]:
        """The run's trainer (:attr:`engine_name`)."""
        return TRAINERS[self.engine_name]

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
