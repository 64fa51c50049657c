"""Server-side arithmetic that every algorithm shares, written once: the weights of a mean,
the weighted mean of stacked client parameters, and flat views of parameter dicts."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from flockfl.engine.dense import LowRankWeight


def mean_weights(counts: np.ndarray, how: str, device: Optional[torch.device] = None) -> torch.Tensor:
    """p_i ∝ n_i (``how='samples'``) or uniform (``'uniform'``): float32, summing to 1."""
    w = np.asarray(counts).astype(np.float64) if how == "samples" else np.ones(len(counts))
    return torch.from_numpy(w / w.sum()).to(torch.float32).to(device)


def weighted_mean(params: dict[str, torch.Tensor], w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Σ_i w_i θ_i over the leading axis of stacked parameters ``params`` ([n, ...] each):
    one matrix-vector product per tensor, in the parameters' dtype and on their device. A
    weight still held as low-rank factors (``TrainResult.raw_params``) is reduced on them."""
    out = {}
    for k, v in params.items():
        if isinstance(v, LowRankWeight):
            out[k] = v.weighted_mean(w)
            continue
        flat = v.reshape(len(w), -1)
        out[k] = (w.to(device=flat.device, dtype=flat.dtype) @ flat).reshape(v.shape[1:])
    return out


def broadcast(params: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Row 0 of stacked parameters as a stacked view of ``n`` copies (every client starts from
    the one global model; no memory is copied)."""
    return {k: v[:1].expand(n, *v.shape[1:]) for k, v in params.items()}


def rows(params: dict[str, torch.Tensor], idx: Optional[np.ndarray]) -> dict[str, torch.Tensor]:
    """The stacked rows ``idx`` of every tensor (all of them when ``idx`` is None)."""
    if idx is None:
        return params
    sel = torch.from_numpy(np.asarray(idx, np.int64))
    return {k: v[sel.to(v.device)] for k, v in params.items()}


def flatten(params: dict[str, torch.Tensor], names: Optional[list[str]] = None, lead: int = 1) -> torch.Tensor:
    """The tensors ``names`` (default: all, in dict order) as one [*lead_shape, P] matrix, the
    first ``lead`` axes kept (1: stacked parameters → [n, P])."""
    names = list(params) if names is None else names
    first = params[names[0]]
    return torch.cat([params[k].reshape(*first.shape[:lead], -1) for k in names], -1)


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], lead: int = 1) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flatten`: [*lead_shape, P] → tensors shaped like ``like``'s
    (past its first ``lead`` axes), as views of ``flat``."""
    out, a = {}, 0
    for k, v in like.items():
        size = int(np.prod(v.shape[lead:], dtype=np.int64))
        out[k] = flat[..., a : a + size].reshape(*flat.shape[:-1], *v.shape[lead:])
        a += size
    return out
