"""The loaded data: :class:`Dataset`, the record every loader of ``dataset.name`` returns (a
built-in one of :mod:`flockfl.data.datasets` or a plugin's): the train and test arrays, the task
and classes, and where the data has them, natural client ids, ground-truth groups and mix sources.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: str = "classification"  # or "regression"
    num_classes: int = 0
    client_train: Optional[np.ndarray] = None  # natural client id of every train sample
    client_test: Optional[np.ndarray] = None
    group: Optional[np.ndarray] = None  # ground-truth cluster of every natural client
    meta: dict = field(default_factory=dict)
    source_train: Optional[np.ndarray] = None  # mix: the source (index into meta["sources"]) of every sample
    source_test: Optional[np.ndarray] = None
    _fingerprint: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_outputs(self) -> int:
        return 1 if self.task == "regression" else self.num_classes

    def fingerprint(self) -> str:
        """SHA-256 of the four arrays. Kept for the same arrays (the same objects, buffers,
        shapes and types): a run's partition check and its partition task, and a sweep's cells,
        share one loaded dataset, and hashing Fashion-MNIST's 55 MB costs ~0.2 s each time. The
        arrays are not changed in place (the loaded dataset is shared)."""
        arrays = (self.x_train, self.y_train, self.x_test, self.y_test)
        key = tuple((id(a), a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str) for a in arrays)
        if self._fingerprint is None or self._fingerprint[0] != key:
            h = hashlib.sha256()
            for a in arrays:
                h.update(str(a.shape).encode())
                h.update(np.ascontiguousarray(a).tobytes())
            self._fingerprint = (key, h.hexdigest())
        return self._fingerprint[1]
