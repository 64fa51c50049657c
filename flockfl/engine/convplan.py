"""A CNN's evaluation forward pass in the order that costs least, the model's own outputs.

Evaluation of the project's CNNs on a CPU is dominated, after the convolutions, by the
elementwise passes over the largest activations: BatchNorm, ReLU and the max-pool each read the
whole convolution output. Reordered, they run on a quarter of it, with the same results:

- **ReLU after the pool.** ``max`` commutes with any non-decreasing function, and ReLU is one:
  ``relu(max(a, b)) == max(relu(a), relu(b))`` exactly, so conv → pool → ReLU gives the bits of
  conv → ReLU → pool.
- **BatchNorm (evaluation mode) after the pool.** Its affine map ``x·s + t`` per channel is
  non-decreasing where ``s ≥ 0``, and float rounding keeps it so; a channel with ``s < 0`` has
  its filter and bias negated first (negation is exact, so the convolution's output is exactly
  negated) and its scale with them, which gives the same products. Then
  conv' → pool → affine → ReLU is, bit for bit, conv → affine → ReLU → pool.
- **The 2×2 maximum in two steps**: rows first (contiguous halves), then columns, which reads
  the activation once instead of four strided times.

The reordering is bit for bit the model's forward. One step is not: a convolution followed by a
2×2 pool runs with its pool in one of flockfl's kernels where its shape has one
(:mod:`flockfl.engine.convkernel`: outputs of 8×8 or more that its blocks tile well), whose sums agree
with oneDNN's to float rounding; ``FLOCKFL_CONV_KERNEL=off`` gives the model's bits again.

:func:`plan` recognises the shapes it knows (a ``nn.Sequential`` of Conv2d / ReLU /
non-overlapping MaxPool2d / Flatten / Linear, as ``lenet5``; :class:`models.ConvBNNet`, as
``cnn_bn`` and ``lenet5_bn``); any other model gets ``None`` and runs as it is.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from flockfl.engine import convkernel

F = nn.functional

Step = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
_PLANS: "weakref.WeakKeyDictionary[nn.Module, Optional[list[Step]]]" = weakref.WeakKeyDictionary()


def max2d(x: torch.Tensor, k: tuple[int, int]) -> torch.Tensor:
    """Non-overlapping k×k max-pool (floor mode) of an NCHW tensor: the maximum over the window's
    rows, then over its columns; the values of ``F.max_pool2d``, exactly."""
    h, w = x.shape[-2] // k[0] * k[0], x.shape[-1] // k[1] * k[1]
    y = x[..., 0:h:k[0], :w]
    for i in range(1, k[0]):
        y = torch.maximum(y, x[..., i:h:k[0], :w])
    out = y[..., 0::k[1]]
    for j in range(1, k[1]):
        out = torch.maximum(out, y[..., j::k[1]])
    return out


def pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def plain_pool(kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False
               ) -> Optional[tuple[int, int]]:
    """The window of a max-pool (``F.max_pool2d``'s arguments) that :func:`max2d` computes: kernel =
    stride, no padding or dilation, floor mode, no indices; None for any other."""
    k = pair(kernel_size)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else pair(stride)
    plain = s == k and pair(padding) == (0, 0) and pair(dilation) == (1, 1) and not ceil_mode and not return_indices
    return k if plain else None


def _pool_size(m: nn.MaxPool2d) -> Optional[tuple[int, int]]:
    return plain_pool(m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices)


def _conv_args(m: nn.Conv2d) -> dict:
    return {"stride": m.stride, "padding": m.padding, "dilation": m.dilation, "groups": m.groups}


def _conv(name: str, m: nn.Conv2d) -> Step:
    kw = _conv_args(m)
    return lambda p, x: F.conv2d(x, p[f"{name}.weight"], p.get(f"{name}.bias"), **kw)


def _linear(name: str, relu: bool = False) -> Step:
    if relu:
        return lambda p, x: torch.relu_(F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias")))
    return lambda p, x: F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))


def _conv_pool(name: str, m: nn.Conv2d, k: tuple[int, int], relu: bool) -> Callable:
    """``(params, x, sign, scale, shift) -> [relu](max2d(conv(x)) · scale + shift)`` of the conv ``name``
    with its filters and bias times ``sign`` (one per filter; None: as they are), the affine map
    only where ``scale`` is given; in one of :mod:`~flockfl.engine.convkernel`'s kernels where it applies."""
    kw = _conv_args(m)
    direct = convkernel.fits(m, k)

    def step(p: dict[str, torch.Tensor], x: torch.Tensor, sign: Optional[torch.Tensor] = None,
             scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
        w, b = p[f"{name}.weight"], p.get(f"{name}.bias")
        if sign is not None:
            w, b = w * sign.reshape(-1, *([1] * (w.dim() - 1))), None if b is None else b * sign
        y = convkernel.conv_pool(x, w, b, pair(m.padding), scale, shift, relu) if direct else None
        if y is not None:
            return y
        y = max2d(F.conv2d(x, w, b, **kw), k)
        if scale is not None:
            y = y * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)
        return torch.relu_(y) if relu else y
    return step


def _conv_bn_relu_pool(conv: str, m: nn.Conv2d, bn: str, eps: float, k: tuple[int, int]) -> Step:
    conv_pool = _conv_pool(conv, m, k, relu=True)

    def step(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # the model's own evaluation-mode BatchNorm arithmetic (models.WeightedBatchNorm2d)
        scale = p[f"{bn}.weight"] * torch.rsqrt(p[f"{bn}.running_var"] + eps)
        shift = p[f"{bn}.bias"] - p[f"{bn}.running_mean"] * scale
        sign = torch.where(scale < 0, -1.0, 1.0).to(scale.dtype)
        return conv_pool(p, x, sign, scale * sign, shift)
    return step


def _sequential(model: nn.Sequential) -> Optional[list[Step]]:
    mods = list(model.named_children())
    steps: list[Step] = []
    i = 0
    while i < len(mods):
        name, m = mods[i]
        nxt = [type(mm) for _, mm in mods[i + 1:i + 3]]
        if type(m) is nn.Conv2d and nxt == [nn.ReLU, nn.MaxPool2d] and _pool_size(mods[i + 2][1]):
            steps.append(_conv_pool(name, m, _pool_size(mods[i + 2][1]), relu=True))
            i += 3
            continue
        if type(m) is nn.Conv2d:
            steps.append(_conv(name, m))
        elif type(m) is nn.Linear:
            steps.append(_linear(name))
        elif type(m) is nn.ReLU:
            steps.append(lambda p, x: torch.relu(x))
        elif type(m) is nn.Flatten and (m.start_dim, m.end_dim) == (1, -1):
            steps.append(lambda p, x: x.flatten(1))
        elif type(m) is nn.MaxPool2d and _pool_size(m):
            steps.append(lambda p, x, k=_pool_size(m): max2d(x, k))
        else:
            return None
        i += 1
    return steps


def _conv_bn_net(model: nn.Module) -> list[Step]:
    steps: list[Step] = []
    for i in range(1, model.n_conv + 1):
        steps.append(_conv_bn_relu_pool(f"conv{i}", getattr(model, f"conv{i}"), f"bn{i}", getattr(model, f"bn{i}").eps, (2, 2)))
    steps.append(lambda p, x: x.flatten(1))
    steps += [_linear(f"fc{i}", relu=i < model.n_fc) for i in range(1, model.n_fc + 1)]
    return steps


def plan(model: nn.Module) -> Optional[list[Step]]:
    """The steps of ``model``'s evaluation forward pass in the cheap order, or None where its
    shape is not one this module knows (kept per model)."""
    if model not in _PLANS:
        from models import ConvBNNet, WeightedBatchNorm2d

        if type(model) is ConvBNNet and all(type(getattr(model, f"bn{i}")) is WeightedBatchNorm2d
                                            for i in range(1, model.n_conv + 1)):
            _PLANS[model] = _conv_bn_net(model)
        elif type(model) is nn.Sequential and any(type(m) is nn.Conv2d for m in model):
            _PLANS[model] = _sequential(model)
        else:
            _PLANS[model] = None
    return _PLANS[model]


def run(steps: list[Step], params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for step in steps:
        x = step(params, x)
    return x
