"""PyTorch architectures, keyed by name in :data:`MODELS`.

Every builder takes (input_shape, num_outputs, hidden) and returns an ``nn.Module``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


def _flat_dim(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


def mclr(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), num_outputs))


def mlp(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """One hidden ReLU layer (IFCA's MNIST model is 784-200-10)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), hidden), nn.ReLU(), nn.Linear(hidden, num_outputs))


def lenet5(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """LeNet-5 for 1×28×28 (5×5 convs, padding 2 on the first) or 1×8×8 inputs (3×3 convs)."""
    if len(input_shape) != 3:
        raise ValueError(f"lenet5 needs C×H×W images, got input shape {input_shape}")
    c, h, w = input_shape
    if h >= 28:
        convs = [nn.Conv2d(c, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)]
        flat = 16 * ((h // 2 - 4) // 2) * ((w // 2 - 4) // 2)
    else:
        convs = [nn.Conv2d(c, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        flat = 16 * (h // 4) * (w // 4)
    return nn.Sequential(*convs, nn.Flatten(), nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_outputs))


def linear(input_shape: tuple[int, ...], num_outputs: int = 1, hidden: int = 0) -> nn.Module:
    """Linear regression without bias (IFCA's synthetic model: y = ⟨x, θ⟩)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), num_outputs, bias=False))


MODELS: dict[str, Callable[..., nn.Module]] = {"mclr": mclr, "mlp": mlp, "lenet5": lenet5, "linear": linear}


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), num_outputs, hidden)


def init_params(model: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh parameters drawn from ``generator`` (PyTorch's default init schemes, never global RNG)."""
    out = {}
    for name, p in model.named_parameters():
        t = torch.empty_like(p)
        if name.endswith("bias"):
            fan_in = p.shape[0]
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            weight = getattr(owner, "weight", None)
            if weight is not None:
                fan_in = weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            t.uniform_(-bound, bound, generator=generator)
        else:
            # kaiming_uniform(a=√5), the default of nn.Linear and nn.Conv2d
            fan_in = p[0].numel()
            bound = math.sqrt(6 / ((1 + 5) * fan_in))
            t.uniform_(-bound, bound, generator=generator)
        out[name] = t
    return out
