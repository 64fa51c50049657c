"""Per-sample losses and stacked-parameter helpers shared by both trainers."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, vmap


def per_sample_loss(out: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy for classification; squared error (no ½, as in IFCA) for regression."""
    if task == "regression":
        return (out.reshape(y.shape) - y) ** 2
    return nn.functional.cross_entropy(out, y, reduction="none")


def correct(out: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    if task == "regression":
        return torch.zeros_like(y)
    return (out.argmax(-1) == y).to(out.dtype)


def stack(params: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([p[k] for p in params]) for k in params[0]}


def index_params(params: dict[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in params.items()}


def num_params(params: dict[str, torch.Tensor], stacked: bool = True) -> int:
    return sum(v[0].numel() if stacked else v.numel() for v in params.values())


@torch.no_grad()
def losses_under_models(
    model: nn.Module, models: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, task: str, chunk: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss and correctness of every sample under each of k stacked models,
    in one vectorised pass per chunk: returns two [k, N] tensors."""

    from flockfl.engine.dense import dense_forward, dense_layers

    layers = dense_layers(model)

    def one(p, xc, yc):
        out = functional_call(model, p, (xc,))
        return per_sample_loss(out, yc, task), correct(out, yc, task)

    def dense(p, xc, yc):  # the same, as k batched matmuls (no vmap tracing)
        out = dense_forward(p, layers, xc)
        yk = yc.expand(out.shape[0], *yc.shape)
        flat = out.reshape(-1, out.shape[-1])
        return (per_sample_loss(flat, yk.reshape(-1), task).reshape(yk.shape),
                correct(flat, yk.reshape(-1), task).reshape(yk.shape))

    batched = dense if layers is not None else vmap(one, in_dims=(0, None, None))
    losses, hits = [], []
    for a in range(0, len(y), chunk):
        l, h = batched(models, x[a : a + chunk], y[a : a + chunk])
        losses.append(l)
        hits.append(h)
    if not losses:
        k = next(iter(models.values())).shape[0]
        return torch.zeros(k, 0), torch.zeros(k, 0)
    return torch.cat(losses, 1), torch.cat(hits, 1)


def segment_mean(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``values[..., i]`` grouped by ``segment[i]``; returns (means, counts).

    Safe under ``torch.use_deterministic_algorithms`` on CUDA: ``index_add_`` has a
    deterministic CUDA path, while ``torch.bincount`` on CUDA raises there (older torch even
    without weights), so the counts are an integer ``index_add_`` too (exact, as bincount)."""
    lead = values.shape[:-1]
    sums = torch.zeros(*lead, num_segments, dtype=values.dtype, device=values.device)
    sums.index_add_(-1, segment, values)
    counts = torch.zeros(num_segments, dtype=torch.int64, device=segment.device).index_add_(
        0, segment, torch.ones_like(segment, dtype=torch.int64)).to(values.dtype)
    return sums / counts.clamp_min(1), counts


@torch.no_grad()
def stacked_outputs(model: nn.Module, models: dict[str, torch.Tensor], x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """The outputs of each of k stacked models on the same inputs: [k, N, outputs]."""
    from flockfl.engine.dense import dense_forward, dense_layers

    layers = dense_layers(model)
    batched = ((lambda p, xc: dense_forward(p, layers, xc)) if layers is not None
               else vmap(lambda p, xc: functional_call(model, p, (xc,)), in_dims=(0, None)))
    return torch.cat([batched(models, x[a : a + chunk]) for a in range(0, len(x), chunk)], 1)
