"""Materialised client data: every client's samples, transformed, in flat tensors.

Samples are stored back to back (``x[offsets[i]:offsets[i+1]]`` is client i), so unequal
client sizes cost no padding. The cohort trainer gathers batches by global index. The server's
own held-out training samples (``partition.server_holdout``), if any, are ``ClientData.server``.

Two test sets per client (``eval.test_set``): the partition's own split (``ClientData.test``, a
disjoint slice in the client's training class proportions) and the label union (every test
sample of every label the client holds, as the PACFL, FLIS and Sub-FedAvg code). The label
unions overlap, so they are never copied per client: ``ClientData.pool`` holds the test set once
per distinct rotation, sorted by class (:class:`~flockfl.engine.evaluate.TestPool`), and the
evaluation picks each client's classes out of it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from flockfl.data.dataset import Dataset
from flockfl.engine.data import ClientData, Split
from flockfl.engine.evaluate import TestPool, sorted_by_class
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


def test_pool(ds: Dataset, p: Partition) -> Optional[TestPool]:
    """The whole test set once per distinct client rotation (a view), sorted by class, with each
    client's view and label map, and where each row of the partition's test split lies in it;
    None for regression (no labels to hold)."""
    if ds.task != "classification":
        return None
    order, offsets, place = sorted_by_class(ds.y_test, ds.num_classes)
    base = torch.from_numpy(np.ascontiguousarray(ds.x_test[order]))
    angles, view = np.unique(np.asarray(p.angle, np.float64), return_inverse=True)
    views = [base if a == 0 else rotate_images(base, float(a)) for a in angles]
    x = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
    position = np.concatenate([place[np.asarray(ii, np.int64)] for ii in p.test_idx] or [np.zeros(0, np.int64)])
    perm = None if p.label_perm is None else np.asarray(p.label_perm, np.int64)
    return TestPool(x, offsets, view.astype(np.int64), perm, position.astype(np.int64))


def build_client_data(ds: Dataset, p: Partition) -> ClientData:
    return ClientData(
        _materialise(ds.x_train, ds.y_train, p.train_idx, p),
        _materialise(ds.x_test, ds.y_test, p.test_idx, p),
        np.asarray(p.group, np.int64), ds.task, ds.num_classes, ds.input_shape,
        server_split(ds, p), test_pool(ds, p),
    )
