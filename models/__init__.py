"""PyTorch architectures, keyed by name in :data:`MODELS`.

Every builder takes (input_shape, num_outputs, hidden) and returns an ``nn.Module``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from flockfl.plugins import Registry


def _flat_dim(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


def mclr(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), num_outputs))


def mlp(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """One hidden ReLU layer (IFCA's MNIST model is 784-200-10)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), hidden), nn.ReLU(), nn.Linear(hidden, num_outputs))


def _lenet5(input_shape: tuple[int, ...], num_outputs: int, name: str, first_padding: int) -> nn.Module:
    """conv 6 → pool → conv 16 → pool → FC 120 → FC 84 → out, ReLU after every hidden layer:
    5×5 convs on 28×28-or-larger images (``first_padding`` on the first), 3×3 same convs on
    small ones (digits 8×8)."""
    c, k, pad, hw = _conv_geometry(input_shape, name, first_padding)
    convs = [nn.Conv2d(c, 6, k, padding=pad + (first_padding if k == 5 else 0)), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(6, 16, k, padding=pad), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*convs, nn.Flatten(), nn.Linear(16 * hw, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                         nn.Linear(84, num_outputs))


def lenet5(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """LeNet-5 as thesis Table 3.17 (and NIID-Bench's CNN): valid 5×5 convs, so 16·4·4 = 256 FC
    inputs on 28×28 (400 on 32×32); 3×3 same convs on 8×8 digits."""
    return _lenet5(input_shape, num_outputs, "lenet5", 0)


def lenet5_padded(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """LeNet-5 with padding 2 on the first conv (LeCun's 32×32 geometry on 28×28): 16·5·5 = 400
    FC inputs on 28×28 (flockfl's ``lenet5`` before it followed Table 3.17); as ``lenet5`` on 8×8."""
    return _lenet5(input_shape, num_outputs, "lenet5_padded", 2)


class WeightedBatchNorm2d(nn.Module):
    """BatchNorm2d with explicit statistics, for federated cohorts.

    - Training mode normalises with the batch's statistics, weighted by per-sample weights
      (``sample_weight``; padded slots of a vectorised batch have weight 0, so a client's
      statistics are those of its real samples and both trainers agree).
    - Eval mode uses ``running_mean`` / ``running_var``. They are parameters that never
      receive gradient steps (``requires_grad=False``): they travel with the model through
      aggregation and checkpoints like any other entry. Instead of an exponential moving
      average, every local training ends by recomputing them exactly over the client's own
      training data (``calibrate_bn`` in flockfl.engine.trainers, "precise BN"), so a
      client's model carries its own statistics and the server averages them.
    - Without ``sample_weight`` (every sample weighs the same: the reference loop) and without
      ``record``, training mode runs the fused kernel (``F.batch_norm``): the same statistics
      and output to float rounding, several times faster. ``fused = False`` (on the class)
      writes them out instead, the reference the tests hold the fused path to.
    """

    fused = True

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.running_mean = nn.Parameter(torch.zeros(channels), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(channels), requires_grad=False)

    def forward(self, x: torch.Tensor, sample_weight: torch.Tensor | None = None, record: list | None = None) -> torch.Tensor:
        if self.training and sample_weight is None and record is None and self.fused:
            return nn.functional.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.training:
            hw = x.shape[2] * x.shape[3]
            if sample_weight is None:
                w = x.new_full((x.shape[0],), 1.0 / x.shape[0])
            else:
                w = sample_weight / sample_weight.sum().clamp_min(1e-30)
            w = w.reshape(-1, 1, 1, 1) / hw
            mean = (x * w).sum((0, 2, 3))
            var = ((x - mean.reshape(1, -1, 1, 1)) ** 2 * w).sum((0, 2, 3))
            if record is not None:
                record.append((mean, var, x.shape[0] * hw))
        else:
            mean, var = self.running_mean, self.running_var
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale.reshape(1, -1, 1, 1) + (self.bias - mean * scale).reshape(1, -1, 1, 1)


class ConvBNNet(nn.Module):
    """Conv → BN → ReLU → MaxPool blocks, then Linear/ReLU layers (the thesis's BN models).

    ``channel_groups()`` tells structured pruning which tensors each BN channel owns: the
    producing conv's filter and bias, the BN's γ/β/statistics, and the consumer's input
    slice (the next conv's input channel, or the first Linear's ``spatial`` columns)."""

    takes_sample_weight = True

    def __init__(self, in_ch: int, convs: list[int], kernel: int, padding: int, flat_hw: int, fcs: list[int], num_outputs: int):
        super().__init__()
        chans = [in_ch] + convs
        for i in range(len(convs)):
            setattr(self, f"conv{i + 1}", nn.Conv2d(chans[i], chans[i + 1], kernel, padding=padding))
            setattr(self, f"bn{i + 1}", WeightedBatchNorm2d(chans[i + 1]))
        self.n_conv, self.flat_hw = len(convs), flat_hw
        dims = [convs[-1] * flat_hw] + fcs + [num_outputs]
        for i in range(len(dims) - 1):
            setattr(self, f"fc{i + 1}", nn.Linear(dims[i], dims[i + 1]))
        self.n_fc = len(dims) - 1

    def forward(self, x: torch.Tensor, sample_weight: torch.Tensor | None = None, record: list | None = None) -> torch.Tensor:
        for i in range(1, self.n_conv + 1):
            x = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(x), sample_weight, record)
            x = nn.functional.max_pool2d(torch.relu(x), 2)
        x = x.flatten(1)
        for i in range(1, self.n_fc + 1):
            x = getattr(self, f"fc{i}")(x)
            if i < self.n_fc:
                x = torch.relu(x)
        return x

    def channel_groups(self) -> list[dict]:
        out = []
        for i in range(1, self.n_conv + 1):
            last = i == self.n_conv
            out.append({"bn": f"bn{i}", "producer": f"conv{i}", "consumer": "fc1" if last else f"conv{i + 1}",
                        "spatial": self.flat_hw if last else None})
        return out


def _conv_geometry(input_shape: tuple[int, ...], name: str, first_padding: int = 0) -> tuple[int, int, int, int]:
    """(in channels, kernel, padding, H·W after two conv+pool blocks) for 28×28-or-larger or 8×8
    images; ``first_padding`` pads the first of the 5×5 convs."""
    if len(input_shape) != 3:
        raise ValueError(f"{name} needs C×H×W images, got input shape {input_shape}")
    c, h, w = input_shape
    if h >= 28:  # 5×5 valid convs, as the thesis's tables (28 → 24 → 12 → 8 → 4)
        side = lambda d: ((d + 2 * first_padding - 4) // 2 - 4) // 2  # noqa: E731
        return c, 5, 0, side(h) * side(w)
    return c, 3, 1, (h // 4) * (w // 4)  # small images (digits 8×8): 3×3 same convs


def lenet5_bn(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """LeNet-5 + BN (thesis Table 3.17 with BatchNorm2d after each conv, Chapter 4): conv 6 →
    conv 16 → FC 120 → FC 84 → out; 16·4·4 = 256 FC inputs on 28×28, 400 on 32×32."""
    c, k, pad, hw = _conv_geometry(input_shape, "lenet5_bn")
    return ConvBNNet(c, [6, 16], k, pad, hw, [120, 84], num_outputs)


def cnn_bn(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """The thesis's MNIST/EMNIST "5-layer CNN" + BN (spec §2.6): conv 10 → conv 20 → FC 50 →
    out; 21,840 weights and biases on 28×28 (plus 60 BN γ/β and 60 statistics)."""
    c, k, pad, hw = _conv_geometry(input_shape, "cnn_bn")
    return ConvBNNet(c, [10, 20], k, pad, hw, [50], num_outputs)


def pfllib_cnn(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """PFLlib's "4-layer CNN" (FedAvgCNN, its leaderboard's model; spec personalised-baselines.md §1):
    conv 5×5 → 32, ReLU, max-pool 2; conv 5×5 → 64, ReLU, max-pool 2; FC → 512, ReLU; FC → out. No
    padding and no BN: 64·4·4 = 1024 FC inputs on 28×28 (1600 on 32×32), 582,026 parameters on
    Fashion-MNIST; 3×3 same convs on 8×8 digits. Layers are named as PFLlib's (conv1, conv2, fc1,
    and the head ``fc``)."""
    c, k, pad, hw = _conv_geometry(input_shape, "pfllib_cnn")
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(c, 32, k, padding=pad)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, k, padding=pad)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()), ("fc1", nn.Linear(64 * hw, 512)), ("relu3", nn.ReLU()),
        ("fc", nn.Linear(512, num_outputs))]))


def pfl_cnn(input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    """pfl-research's ``simple_cnn`` (its CIFAR-10 benchmark model, benchmarks/model/pytorch/cnn.py):
    conv 3×3 → 32, ReLU, conv 3×3 → 64, ReLU, max-pool 2, FC → 128, ReLU, FC → out; no padding,
    so 64·14·14 = 12,544 FC inputs on 32×32 (1,626,442 parameters on CIFAR-10 shapes). Two
    differences from pfl-research's: no dropout (its 0.25 and 0.5; flockfl's trainers draw no
    per-step masks) and PyTorch's default initialisation instead of Glorot-uniform weights.
    Channels-first input (pfl's takes NHWC and transposes)."""
    c, h, w = input_shape if len(input_shape) == 3 else (1, *input_shape[-2:])
    hw = ((h - 4) // 2) * ((w - 4) // 2)
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(c, 32, 3)), ("relu1", nn.ReLU()), ("conv2", nn.Conv2d(32, 64, 3)), ("relu2", nn.ReLU()),
        ("pool", nn.MaxPool2d(2)), ("flatten", nn.Flatten()), ("fc1", nn.Linear(64 * hw, 128)), ("relu3", nn.ReLU()),
        ("fc", nn.Linear(128, num_outputs))]))


def linear(input_shape: tuple[int, ...], num_outputs: int = 1, hidden: int = 0) -> nn.Module:
    """Linear regression without bias (IFCA's synthetic model: y = ⟨x, θ⟩)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_dim(input_shape), num_outputs, bias=False))


def _check_builder(name: str, fn: object) -> str:
    return "" if callable(fn) else f"{fn!r} is not a function (input_shape, num_outputs, hidden) -> nn.Module"


# the registry of ``model.name``: the built-ins, then the plugins' (flockfl.plugins.register_model)
MODELS: Registry = Registry("model", {"mclr": mclr, "mlp": mlp, "lenet5": lenet5, "lenet5_padded": lenet5_padded,
                                      "linear": linear, "lenet5_bn": lenet5_bn, "cnn_bn": cnn_bn,
                                      "pfllib_cnn": pfllib_cnn, "pfl_cnn": pfl_cnn}, check=_check_builder)


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int, hidden: int = 200) -> nn.Module:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), num_outputs, hidden)


def init_params(model: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh parameters drawn from ``generator`` (PyTorch's default init schemes, never global RNG).

    Every draw happens on the CPU with the CPU ``generator`` and the result is then moved to
    the model's device, so a model on a GPU starts from exactly the values a CPU run draws."""
    out = {}
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype)  # on the CPU, whatever the model's device
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(owner, WeightedBatchNorm2d):  # γ = 1, β = 0, mean 0, var 1 (torch's BN defaults)
            t.fill_(1.0 if name.endswith(("weight", "running_var")) else 0.0)
        elif name.endswith("bias"):
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
        out[name] = t.to(p.device)
    return out
