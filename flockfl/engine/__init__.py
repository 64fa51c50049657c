"""Local training engines: the vectorised cohort trainer and the sequential reference."""

from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TRAINERS, TrainResult, choose_engine, configure_threads, resolve_device, train_cohort, train_reference

__all__ = ["LocalSpec", "TRAINERS", "TrainResult", "choose_engine", "configure_threads", "resolve_device", "train_cohort", "train_reference"]
