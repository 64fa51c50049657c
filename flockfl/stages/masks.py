"""Sub-FedAvg's mask arithmetic (:mod:`flockfl.stages.subfedavg`): magnitude masks, applying
masks, which rows changed, when the first-epoch snapshot is taken, the Hamming distance between
masks, a subnetwork's cache key, and the thesis's communication cost."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from flockfl.engine.schedule import LocalSpec


def thesis_comm_bytes(params: int, pruned_share: float, rounds: int, clients_per_round: int) -> float:
    """Cost = R·K·(32|W| + 32(1−p)|W| + 1·p|W|)/8 bytes (spec §2.8's exact reconstruction)."""
    bits = 32 * params + 32 * (1 - pruned_share) * params + pruned_share * params
    return rounds * clients_per_round * bits / 8


def hamming(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of differing entries."""
    return float((a != b).float().mean()) if a.numel() else 0.0


def subnet_key(params: dict, i: int, stats: list[str], data_version: int) -> str:
    """A digest of client i's subnetwork (every entry but the BN statistics) and the data version."""
    h = hashlib.sha1(str(data_version).encode())
    for k in sorted(params):
        if k not in stats:
            h.update(params[k][i].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def apply_masks(params: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked parameters with every masked entry zeroed (new tensors; unmasked ones shared)."""
    return {k: (v * masks[k] if k in masks else v) for k, v in params.items()}


def changed_rows(new: dict, old: dict, n: int) -> np.ndarray:
    """Per client: does any of the stacked masks differ?"""
    out = np.zeros(n, bool)
    for k in new:
        out |= (new[k] != old[k]).reshape(n, -1).any(1).cpu().numpy()
    return out


def first_mask_steps(spec: LocalSpec, sizes: np.ndarray) -> np.ndarray:
    """The step after which each client takes its first-epoch mask: the end of its first local
    epoch; when one epoch is the whole budget (E = 1, or fixed ``local_steps``), after the first
    fifth of its steps instead (the authors' code compares epoch 1 with epoch 5), so the two masks
    can still differ."""
    out = np.zeros(len(spec.clients), np.int64)
    for i, c in enumerate(spec.clients):
        n = int(sizes[c])
        epochs, steps = spec.work_of(i)
        per_epoch = 1 if spec.full_batch else max(1, -(-n // max(1, min(spec.batch_size, max(n, 1)))))
        total = steps if steps is not None else epochs * per_epoch
        out[i] = per_epoch if (steps is None and epochs >= 2) else max(1, -(-total // 5))
    return out


def flag_rows(flags: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Per-client flags broadcast over a stacked tensor."""
    return torch.from_numpy(np.asarray(flags, bool)).reshape(-1, *([1] * (like.dim() - 1))).to(like.device)


def magnitude_masks(values: torch.Tensor, alive: torch.Tensor, share: np.ndarray, keep_one: bool = False) -> torch.Tensor:
    """Per client (leading axis): ``alive`` with a further ``share[i]`` of its alive entries
    removed, those with the smallest |value| (ties: the lower index first). Never revives."""
    alive_cpu = alive.cpu()  # the ranking runs on the CPU (per-client loop, stable sort), then moves back
    out = alive_cpu.clone()
    c = values.shape[0]
    flat_v = values.detach().abs().reshape(c, -1).cpu()
    flat_a = alive_cpu.reshape(c, -1)
    flat_o = out.reshape(c, -1)
    for i in range(c):
        n_alive = int(flat_a[i].sum())
        k = int(math.floor(share[i] * n_alive + 1e-9))
        if keep_one:
            k = min(k, n_alive - 1)
        if k <= 0:
            continue
        score = torch.where(flat_a[i], flat_v[i].double(), torch.full_like(flat_v[i], float("inf"), dtype=torch.float64))
        drop = torch.sort(score, stable=True).indices[:k]
        flat_o[i, drop] = False
    return out.to(alive.device)
