"""The engine's input: every client's samples in flat tensors.

Samples are stored back to back (``x[offsets[i]:offsets[i+1]]`` is client i), so unequal
client sizes cost no padding. The cohort trainer gathers batches by global index. The server's
own held-out training samples (``partition.server_holdout``), if any, are ``ClientData.server``.
``flockfl.data.clients`` builds them from a dataset and a partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from flockfl.engine.evaluate import TestPool


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor
    offsets: np.ndarray  # (clients + 1,)

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def client(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.x[a:b], self.y[a:b]


@dataclass
class ClientData:
    train: Split
    test: Split
    group: np.ndarray
    task: str
    num_classes: int
    input_shape: tuple[int, ...]
    # the server's held-out training samples (one block, offsets [0, h], untransformed), or None
    server: Optional[Split] = None
    # every test sample once per client transform, for the label-union test sets (built with the
    # partition by flockfl.data.clients; None: the evaluation derives it from ``test`` when needed)
    pool: Optional["TestPool"] = None

    @property
    def num_clients(self) -> int:
        return len(self.group)

    @property
    def num_outputs(self) -> int:
        return 1 if self.task == "regression" else self.num_classes

    def to(self, device: torch.device) -> "ClientData":
        mv = lambda s: Split(s.x.to(device), s.y.to(device), s.offsets)  # noqa: E731
        return ClientData(mv(self.train), mv(self.test), self.group, self.task, self.num_classes, self.input_shape,
                          None if self.server is None else mv(self.server), None if self.pool is None else self.pool.to(device))
