"""An emulated CUDA device for CPU-only machines: real arithmetic, CUDA's placement rules.

Inside ``fake_cuda()``, a tensor "on the GPU" is a wrapper that reports device ``meta`` and
holds a real CPU tensor; arithmetic runs on the CPU, so results are bit-identical to a CPU
run. Every op is checked as CUDA would check it, and a violation raises :class:`DeviceError`:

- all tensor operands on one device (CPU 0-dim tensors allowed, as CUDA allows CPU scalars);
- indexing a GPU tensor with CPU indices is allowed, GPU indices into a CPU tensor are not,
  and ``index_put_`` values must sit with the indexed tensor;
- copies across devices (``.to``, ``.cpu()``, ``copy_``) are allowed;
- a random draw on the GPU with a CPU ``torch.Generator`` is refused;
- ``.numpy()`` of a GPU tensor is refused (``.tolist()``, ``.item()``, ``float()`` work);
- under ``torch.use_deterministic_algorithms(True)``, the ops that raise on CUDA in that
  mode raise here (``torch.use_deterministic_algorithms``'s documented list; ``bincount``
  always, as older torch versions raise even without weights).

It finds device bugs (tensors created without ``device=``, CPU generators, missing
``.cpu()``) without a GPU. It does not model speed, memory, streams, or kernels that
compute differently on a GPU. Code under test gets the device from
``flockfl.rounds.resolve_device``: :func:`patch_resolve_device` makes it return the fake one.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

GPU = torch.device("meta")  # what a fake GPU tensor reports (autograd handles meta on the CPU queue)
aten = torch.ops.aten


class DeviceError(RuntimeError):
    pass


class OnGpu(torch.Tensor):
    """A CPU tensor (``elem``) posing as a GPU tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
                                                dtype=elem.dtype, layout=elem.layout, device=GPU,
                                                requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def tolist(self):  # CUDA tensors allow it (a copy to the host)
        return self.elem.tolist()

    def __repr__(self):
        return f"OnGpu({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten._has_compatible_shallow_copy_type.default,
                aten.lift_fresh.default, aten.detach.default, aten.alias.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
            aten._unsafe_index.Tensor}
NONDETERMINISTIC = {
    "aten::histc", "aten::put_", "aten::put", "aten::bincount", "aten::adaptive_avg_pool2d_backward",
    "aten::_adaptive_avg_pool2d_backward", "aten::adaptive_avg_pool3d_backward", "aten::_adaptive_avg_pool3d_backward",
    "aten::adaptive_max_pool2d_backward", "aten::avg_pool3d_backward", "aten::fractional_max_pool2d_backward",
    "aten::fractional_max_pool3d_backward", "aten::max_unpool2d", "aten::max_unpool3d", "aten::reflection_pad1d_backward",
    "aten::reflection_pad2d_backward", "aten::reflection_pad3d_backward", "aten::grid_sampler_2d_backward",
    "aten::grid_sampler_3d_backward", "aten::upsample_linear1d_backward", "aten::upsample_bilinear2d_backward",
    "aten::upsample_bicubic2d_backward", "aten::upsample_trilinear3d_backward", "aten::_ctc_loss_backward",
    "aten::_embedding_bag_backward",
}


def _is_gpu(t) -> bool:
    return isinstance(t, OnGpu)


def _check_deterministic(func, args, kwargs) -> None:
    if not torch.are_deterministic_algorithms_enabled():
        return
    name = func._schema.name
    bad = name in NONDETERMINISTIC
    if name in ("aten::median", "aten::nanmedian", "aten::kthvalue") and func._overloadname != "default":
        bad = True  # with an indices output
    if name == "aten::cumsum" and (args[0].dtype.is_floating_point or args[0].dtype.is_complex):
        bad = True
    if name == "aten::nll_loss2d_forward" and (args[3] if len(args) > 3 else kwargs.get("reduction", 1)) != 0:
        bad = True
    if name.startswith("aten::scatter_reduce") and "prod" in [a for a in (*args, *kwargs.values()) if isinstance(a, str)]:
        bad = True
    if bad:
        raise DeviceError(f"{name} has no deterministic CUDA implementation (torch.use_deterministic_algorithms)")


def _dispatch(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    any_gpu = any(_is_gpu(t) for t in tensors)
    dev_kw = kwargs.get("device")
    to_gpu = dev_kw is not None and torch.device(dev_kw).type == GPU.type
    on_gpu = to_gpu if dev_kw is not None else any_gpu

    if any_gpu and func not in CROSS_DEVICE:
        if func in INDEXING:
            if not _is_gpu(args[0]):
                raise DeviceError(f"{func}: indices on the GPU for a CPU tensor")
            values = [v for v in (*args[2:], kwargs.get("values")) if isinstance(v, torch.Tensor)]
            if any(not _is_gpu(v) and v.dim() > 0 for v in values):
                raise DeviceError(f"{func}: values on the CPU for a GPU tensor")
        else:
            cpu = [tuple(t.shape) for t in tensors if not _is_gpu(t) and t.dim() > 0]
            if cpu:
                raise DeviceError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                  f"cuda:0 and cpu! ({func}; CPU operands of shapes {cpu})")
    if on_gpu:
        if any(isinstance(g, torch.Generator) and g.device.type == "cpu" for g in flat):
            raise DeviceError(f"Expected a 'cuda' device type for generator but found 'cpu' ({func})")
        _check_deterministic(func, args, kwargs)

    unwrap = lambda t: t.elem if _is_gpu(t) else t  # noqa: E731
    uargs, ukwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if to_gpu:
        ukwargs["device"] = torch.device("cpu")
    out = func(*uargs, **ukwargs)

    schema = func._schema
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write \
            and schema.returns and schema.returns[0].alias_info is not None:
        return args[0]  # an in-place op returns its own first argument
    if "out" in kwargs:
        return kwargs["out"]
    if not on_gpu:
        return out
    return tree_map(lambda t: OnGpu(t) if isinstance(t, torch.Tensor) and not _is_gpu(t) else t, out)


class _FakeCuda(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


@contextlib.contextmanager
def fake_cuda(deterministic: bool = True):
    """Emulate a GPU inside the block; yields its device. ``deterministic``: as
    ``train.fast_math=false`` (the default) turns on ``torch.use_deterministic_algorithms``."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with _FakeCuda():
            yield GPU
    finally:
        torch.use_deterministic_algorithms(was)


@contextlib.contextmanager
def patch_resolve_device(device: torch.device):
    """``flockfl.preparation.prepare`` puts the data (and so the model) on ``device``."""
    import flockfl.preparation as preparation

    orig = preparation.resolve_device
    preparation.resolve_device = lambda name, fast_math=False: device
    try:
        yield
    finally:
        preparation.resolve_device = orig


def available() -> bool:
    """Whether this torch supports the emulation (wrapper subclasses under autograd and vmap)."""
    try:
        from torch.func import grad, vmap

        with fake_cuda(deterministic=False) as dev:
            x = torch.ones(2, 3).to(dev)
            g = vmap(grad(lambda v: (v * v).sum()))(x)
            ok = _is_gpu(g) and g.cpu().tolist() == [[2.0] * 3] * 2
            try:
                x + torch.ones(2, 3)
                ok = False
            except DeviceError:
                pass
        return ok
    except Exception:
        return False
