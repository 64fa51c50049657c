"""Materialised client data: every client's samples, transformed, in flat tensors.

Samples are stored back to back (``x[offsets[i]:offsets[i+1]]`` is client i), so unequal
client sizes cost no padding. The cohort trainer gathers batches by global index. The server's
own held-out training samples (``partition.server_holdout``), if any, are ``ClientData.server``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from flockfl.data.datasets import Dataset
from flockfl.engine.data import ClientData, Split
from flockfl.data.partition import Partition


def rotate_images(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate N×C×H×W images counter-clockwise: exact for multiples of 90°, bilinear otherwise."""
    quarter = angle / 90.0
    if abs(quarter - round(quarter)) < 1e-9:
        return torch.rot90(x, int(round(quarter)) % 4, dims=(-2, -1))
    theta = torch.deg2rad(torch.tensor(angle, dtype=torch.float32))
    c, s = torch.cos(theta), torch.sin(theta)
    # grid_sample maps output coordinates to input ones: the inverse rotation, in (x, y↓) axes
    mat = torch.stack([torch.stack([c, -s, torch.tensor(0.0)]), torch.stack([s, c, torch.tensor(0.0)])])
    grid = torch.nn.functional.affine_grid(mat.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    return torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _materialise(x: np.ndarray, y: np.ndarray, idx: list[np.ndarray], p: Partition) -> Split:
    xs, ys = [], []
    for i, ii in enumerate(idx):
        xi = torch.from_numpy(np.ascontiguousarray(x[ii]))
        yi = y[ii]
        if p.angle[i] != 0:
            xi = rotate_images(xi, float(p.angle[i]))
        if p.label_perm is not None:
            yi = p.label_perm[i][yi]
        xs.append(xi)
        ys.append(torch.from_numpy(np.ascontiguousarray(yi)))
    offsets = np.cumsum([0] + [len(ii) for ii in idx]).astype(np.int64)
    return Split(torch.cat(xs).contiguous(), torch.cat(ys).contiguous(), offsets)


def server_split(ds: Dataset, p: Partition) -> Optional[Split]:
    """The held-out training samples ``p.server_idx`` as one block, in their stored (random)
    order and without any client's transform; None when nothing was held out."""
    if len(p.server_idx) == 0:
        return None
    idx = np.asarray(p.server_idx, np.int64)
    return Split(torch.from_numpy(np.ascontiguousarray(ds.x_train[idx])), torch.from_numpy(np.ascontiguousarray(ds.y_train[idx])),
                 np.array([0, len(idx)], np.int64))


def build_client_data(ds: Dataset, p: Partition) -> ClientData:
    return ClientData(
        _materialise(ds.x_train, ds.y_train, p.train_idx, p),
        _materialise(ds.x_test, ds.y_test, p.test_idx, p),
        np.asarray(p.group, np.int64), ds.task, ds.num_classes, ds.input_shape,
        server_split(ds, p),
    )
