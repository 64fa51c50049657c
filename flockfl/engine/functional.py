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


# ---------------------------------------------------------------------- the stacked forward
# A cohort's forward pass written once for all its clients, without vmap: convolutions are one
# grouped convolution (clients folded into channels, as vmap's batching rule does), linear
# layers one bmm, and autograd differentiates the sum of the clients' losses, which gives each
# client its own gradient. Conv and linear layers get their backward written out (below) in the
# operand order vmap's own backward uses, so with contiguous NCHW convolutions and BN written out
# this path's gradients equal vmap(grad)'s bit for bit (tests/test_conv_vectorized.py checks it)
# while it skips vmap's per-op dispatch and batching rules. By default (``train.conv_layout=auto``
# on a CPU) the convolutions run channels-last and BN runs fused in steps without padding
# (flockfl.engine.bn): faster, and equal to vmap's and the reference loop's to float rounding.


def stacked_plan(model: nn.Module) -> list[tuple] | None:
    """The model as a list of layer ops the stacked forward runs, or None when a layer is not
    one it knows (the caller then falls back to vmap): ``nn.Sequential`` stacks of Conv2d,
    ReLU, MaxPool2d, Flatten and Linear, and the BN nets (``models.ConvBNNet``)."""
    from models import ConvBNNet

    ops: list[tuple] = []
    if isinstance(model, ConvBNNet):
        for i in range(1, model.n_conv + 1):
            conv = getattr(model, f"conv{i}")
            if not _plain_conv(conv):
                return None
            ops += [("conv", f"conv{i}", conv), ("bn", f"bn{i}", getattr(model, f"bn{i}")), ("relu",),
                    ("pool", {"kernel_size": 2})]
        ops.append(("flatten",))
        for i in range(1, model.n_fc + 1):
            ops.append(("linear", f"fc{i}"))
            if i < model.n_fc:
                ops.append(("relu",))
        return ops
    if not isinstance(model, nn.Sequential):
        return None
    for name, m in model.named_children():
        if isinstance(m, nn.Conv2d) and _plain_conv(m):
            ops.append(("conv", name, m))
        elif isinstance(m, nn.ReLU):
            ops.append(("relu",))
        elif isinstance(m, nn.MaxPool2d):
            ops.append(("pool", {"kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
                                 "dilation": m.dilation, "ceil_mode": m.ceil_mode}))
        elif isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1:
            ops.append(("flatten",))
        elif isinstance(m, nn.Linear):
            ops.append(("linear", name))
        else:
            return None
    return ops


def _plain_conv(m: nn.Conv2d) -> bool:
    return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)


CONV_LAYOUTS = ("auto", "channels_last", "contiguous")


def conv_layout(model: nn.Module) -> str:
    """``train.conv_layout`` as the run set it on its model (``flockfl.preparation``); a model
    built elsewhere has the default, ``auto``."""
    return getattr(model, "conv_layout", "auto")


def memory_format(layout: str, device: torch.device):
    """The memory format of the stacked path's convolutions (and of evaluation's conv inputs):
    ``torch.channels_last`` for ``channels_last``, and for ``auto`` on a CPU; None (contiguous
    NCHW, vmap's layout, bit for bit) for ``contiguous``, and for ``auto`` elsewhere (unmeasured
    on GPUs). On the 2-core CPU, one thread, oneDNN's channels-last grouped convolutions of 10
    clients were 2-5x faster (LeNet-5 training 1.5x, ``cnn_bn`` 1.25x, docs/benchmarks.md), and
    they sum in another order: the bits differ from vmap's, to float rounding."""
    if layout == "channels_last" or (layout == "auto" and device.type == "cpu"):
        return torch.channels_last
    return None


def stacked_forward(plan: list[tuple], params: dict[str, torch.Tensor], x: torch.Tensor,
                    sample_weight: torch.Tensor | None = None, fmt=None, record: list | None = None) -> torch.Tensor:
    """Outputs [C, B, out] of C clients' models (stacked ``params``) on their own inputs
    x [C, B, ...]. Feature maps are kept as [B, C·channels, H, W], the layout of a grouped
    convolution over the clients (``fmt``: its memory format, None for contiguous);
    ``sample_weight`` [C, B] weights each client's BN statistics (None: every slot is real and
    weighs the same, and BN runs fused); ``record`` collects each BN's statistics
    ([C, channels] mean and biased variance, [C] element counts: :func:`flockfl.engine.bn.calibrate_bn`)."""
    c, b = x.shape[:2]
    spatial = plan[0][0] == "conv"
    a = x.transpose(0, 1).reshape(b, c * x.shape[2], *x.shape[3:]) if spatial else x
    for i, op in enumerate(plan):
        kind = op[0]
        if kind == "relu" and i + 1 < len(plan) and plan[i + 1][0] == "pool":
            continue  # fused into the pooling below
        if kind == "pool":
            a = _Pool.apply(a, op[1], plan[i - 1][0] == "relu", fmt)
        elif kind == "conv":
            m, w, bias = op[2], params[f"{op[1]}.weight"], params.get(f"{op[1]}.bias")
            a = _GroupedConv.apply(a, w.reshape(c * w.shape[1], *w.shape[2:]), None if bias is None else bias.reshape(-1),
                                   m.stride, m.padding, m.dilation, c, fmt)
        elif kind == "bn":
            a = stacked_bn(a, params[f"{op[1]}.weight"], params[f"{op[1]}.bias"], op[2].eps, sample_weight, c, record)
        elif kind == "relu":
            a = torch.relu(a)
        elif kind == "flatten":
            a = a.reshape(b, c, -1).transpose(0, 1) if spatial else a.reshape(c, b, -1)
            spatial = False
        else:  # linear
            a = _StackedLinear.apply(a, params[f"{op[1]}.weight"], params.get(f"{op[1]}.bias"))
    return a


def _fused() -> bool:
    from models import WeightedBatchNorm2d

    return WeightedBatchNorm2d.fused


def stacked_bn(a: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float, sample_weight, c: int,
               record: list | None = None) -> torch.Tensor:
    """``models.WeightedBatchNorm2d`` in training mode for C clients at once, on feature maps
    a [B, C·channels, H, W]: each client's batch statistics and its own γ and β. With
    ``sample_weight`` [C, B], the weighted statistics written out (the module's arithmetic, so
    its bits); without, every slot counts the same: one fused ``F.batch_norm`` over the C·channels
    channels (or, when ``record`` asks for the statistics, ``var_mean`` and one affine pass).
    ``record`` gets ([C, channels] mean, [C, channels] biased variance, H·W)."""
    b, hw = a.shape[0], a.shape[2] * a.shape[3]
    if sample_weight is None and record is None and _fused():
        return nn.functional.batch_norm(a, None, None, gamma.reshape(-1), beta.reshape(-1), True, 0.0, eps)
    x = a.reshape(b, c, a.shape[1] // c, a.shape[2], a.shape[3])
    if sample_weight is None and _fused():
        var, mean = torch.var_mean(x, (0, 3, 4), correction=0)
    else:
        if sample_weight is None:
            w = x.new_full((c, b), 1.0 / b)
        else:
            w = sample_weight / sample_weight.sum(1, keepdim=True).clamp_min(1e-30)
        w = (w / hw).transpose(0, 1).reshape(b, c, 1, 1, 1)
        mean = (x * w).sum((0, 3, 4))  # [C, channels]
        var = ((x - mean.reshape(1, *mean.shape, 1, 1)) ** 2 * w).sum((0, 3, 4))
    if record is not None:
        record.append((mean, var, hw))
    scale = gamma * torch.rsqrt(var + eps)
    shift = beta - mean * scale
    return (x * scale.reshape(1, *scale.shape, 1, 1) + shift.reshape(1, *shift.shape, 1, 1)).reshape(a.shape)


class _GroupedConv(torch.autograd.Function):
    """C clients' convolutions as one grouped convolution, in memory format ``fmt`` (None:
    contiguous); the bias gradient summed per client as vmap sums it."""

    @staticmethod
    def forward(ctx, a, weight, bias, stride, padding, dilation, groups, fmt):
        if fmt is not None:
            a, weight = a.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
        ctx.save_for_backward(a, weight)
        ctx.conf = (stride, padding, dilation, groups, bias is not None, fmt)
        return nn.functional.conv2d(a, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        a, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias, fmt = ctx.conf
        gc = g if fmt is None else g.contiguous(memory_format=fmt)
        ga, gw, _ = torch.ops.aten.convolution_backward(gc, a, weight, None, stride, padding, dilation, False, [0, 0],
                                                         groups, [ctx.needs_input_grad[0], True, False])
        if fmt is not None:
            gw = gw.contiguous()
        gb = None
        if has_bias:
            b, ch, h, w = g.shape
            gb = gc.reshape(b, groups, ch // groups, h, w).sum((0, 3, 4)).reshape(-1)
        return ga, gw, gb, None, None, None, None, None


class _Pool(torch.autograd.Function):
    """Max pooling (after a ReLU when ``relu``) in the channels-last layout, where the CPU kernel
    is about 3× faster; the output and the input gradient are in format ``fmt`` (None:
    contiguous again). The values are exact: ReLU commutes with max, so ReLU runs on the pooled
    map, and the gradient reaches the same (first) maximum of each window, or nothing where the
    maximum is not positive."""

    @staticmethod
    def forward(ctx, a, kw, relu, fmt=None):
        a = a.contiguous(memory_format=torch.channels_last)
        ctx.args = (kw["kernel_size"], kw.get("stride") or [], kw.get("padding", 0), kw.get("dilation", 1),
                    kw.get("ceil_mode", False))
        out, idx = torch.ops.aten.max_pool2d_with_indices(a, *ctx.args)
        if relu:
            out = torch.relu(out)
        out = out.contiguous(memory_format=fmt or torch.contiguous_format)
        ctx.save_for_backward(a, idx, out)
        ctx.relu, ctx.fmt = relu, fmt
        return out

    @staticmethod
    def backward(ctx, g):
        a, idx, out = ctx.saved_tensors
        if ctx.relu:
            g = torch.ops.aten.threshold_backward(g, out, 0)
        ga = torch.ops.aten.max_pool2d_with_indices_backward(g.contiguous(memory_format=torch.channels_last), a,
                                                             *ctx.args, idx)
        return ga.contiguous(memory_format=ctx.fmt or torch.contiguous_format), None, None, None


class _StackedLinear(torch.autograd.Function):
    """C clients' linear layers as one bmm; the backward in vmap's operand order."""

    @staticmethod
    def forward(ctx, a, weight, bias):
        ctx.save_for_backward(a, weight)
        out = torch.bmm(a, weight.transpose(1, 2))
        return out if bias is None else out + bias.unsqueeze(1)

    @staticmethod
    def backward(ctx, g):
        a, weight = ctx.saved_tensors
        ga = torch.bmm(g, weight) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), a) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.needs_input_grad[2] else None
        return ga, gw, gb


def stacked_step(model: nn.Module, plan: list[tuple], task: str, frozen: list[str]):
    """``step(params, x, y, w, full=None) → (gradients, losses)`` for a cohort, as
    ``vmap(grad_and_value)`` of the weighted loss gives them (frozen entries get a zero
    gradient). BN takes its statistics over the real samples: fused (``F.batch_norm``) in a step
    where no slot is padded (``full``: whether every weight is positive, found from ``w`` when
    not given), the weighted statistics written out otherwise. The convolutions run in the
    model's :func:`conv_layout`."""
    weighted = getattr(model, "takes_sample_weight", False)
    layout = conv_layout(model)

    def step(params, x, y, w, full=None):
        leaves = {k: v.detach().requires_grad_(k not in frozen) for k, v in params.items()}
        if weighted and full is None:
            full = bool((w > 0).all())
        out = stacked_forward(plan, leaves, x, None if not weighted or full else w, memory_format(layout, x.device))
        c, b = y.shape[:2]
        loss = (per_sample_loss(out.reshape(c * b, -1), y.reshape(c * b, *y.shape[2:]), task).reshape(c, b) * w).sum(1)
        keys = [k for k in leaves if k not in frozen]
        grads = dict(zip(keys, torch.autograd.grad(loss.sum(), [leaves[k] for k in keys])))
        return {k: grads[k] if k in grads else torch.zeros_like(v) for k, v in params.items()}, loss.detach()

    return step
