"""Local training engines: the vectorised cohort trainer and the sequential reference."""

import os

# deterministic cuBLAS (train.fast_math=false on CUDA) needs a fixed workspace, set before cuBLAS
# starts; harmless on the CPU and for fast_math runs
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from flockfl.engine.schedule import LocalSpec  # noqa: E402
from flockfl.engine.trainers import TRAINERS, TrainResult, train_cohort, train_reference  # noqa: E402
from flockfl.engine.probe import choose_engine  # noqa: E402
from flockfl.engine.runtime import configure_cuda, configure_threads, resolve_device  # noqa: E402

__all__ = ["LocalSpec", "TRAINERS", "TrainResult", "choose_engine", "configure_cuda", "configure_threads", "resolve_device",
           "train_cohort", "train_reference"]
