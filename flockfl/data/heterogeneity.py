"""How heterogeneous a partition is: thesis Table 5.3's measures (spec ``flis-pacfl-scniid.md`` §3.4).

For the clients' training data (after each client's transform: a rotated client's images are
rotated, a label-swapped client's labels permuted, as in :mod:`flockfl.data.clients`):

- ``emd``: the mean over client pairs of the label EMD between their label distributions, with
  the 0/1 ground distance, i.e. the total variation ½Σ_c|p_c − q_c| ∈ [0, 1]
  (:func:`flockfl.clustering.label_emd`);
- ``angle_eq31``: the mean over client pairs of Eq. 3.1/5.1, the smallest principal angle between
  the clients' whole-data subspaces U_p (p left singular vectors of the raw samples), in degrees;
- ``angle_eq32``: the mean over client pairs of Eq. 3.2/5.2, Σ_k arccos|u_kᵀw_k| over the p
  matched columns, in degrees (so up to p·90°).

Larger means more heterogeneous. The thesis does not state its units for the angles (its values
look like radians or a normalised scale), so only the ordering compares with Table 5.3.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.clustering import data_basis, label_proportions, mean_pairwise
from flockfl.clustering.similarity import pairwise_label_emd
from flockfl.clustering.subspaces import proximity_matrix, stacked_proximity
from flockfl.data.clients import rotate_images
from flockfl.data.dataset import Dataset
from flockfl.data.partition import Partition
from flockfl.rng import np_rng


def measured_clients(num_clients: int, max_clients: int, seed: int) -> np.ndarray:
    """All clients, or a sorted random subset of ``max_clients`` of them from the
    (seed, "heterogeneity") stream."""
    if num_clients <= max_clients:
        return np.arange(num_clients)
    return np.sort(np_rng(seed, purpose="heterogeneity").choice(num_clients, size=max_clients, replace=False))


def client_train_data(ds: Dataset, part: Partition, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Client i's training samples and labels as it sees them (its rotation and label map applied)."""
    idx = part.train_idx[i]
    x, y = ds.x_train[idx], ds.y_train[idx]
    if part.angle[i] != 0:
        x = rotate_images(torch.from_numpy(np.ascontiguousarray(x)), float(part.angle[i])).numpy()
    if part.label_perm is not None:
        y = part.label_perm[i][y]
    return x, y


def heterogeneity(ds: Dataset, part: Partition, p: int = 3, max_clients: int = 200, seed: int = 0) -> dict:
    """Mean pairwise label EMD and Eq. 3.1 / 3.2 angles between clients (Table 5.3), measured on
    at most ``max_clients`` clients (a deterministic random subset beyond that). Clients without
    training samples are left out of the angles. Returns JSON-able numbers."""
    clients = measured_clients(part.num_clients, max_clients, seed)
    hist, bases = [], []
    for i in clients:
        x, y = client_train_data(ds, part, int(i))
        hist.append(np.bincount(y, minlength=ds.num_classes))
        if len(y):
            # the Gram route gives the SVD's U_p up to column signs, which neither measure sees
            bases.append(data_basis(x, p, method="gram"))
    emd = mean_pairwise(pairwise_label_emd(label_proportions(np.stack(hist))))
    # all pairs at once when every basis has p columns (a client with fewer samples has fewer)
    same = len({u.shape for u in bases}) <= 1
    prox = stacked_proximity if same else proximity_matrix
    return {
        "emd": emd,
        "angle_eq31": mean_pairwise(prox(bases, "smallest_angle")),
        "angle_eq32": mean_pairwise(prox(bases, "trace")),
        "p": int(p),
        "clients_measured": int(len(clients)),
        "clients_total": int(part.num_clients),
    }
