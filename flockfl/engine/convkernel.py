"""Small convolutions and their 2×2 max-pool in one kernel each (evaluation, CPU).

``lenet5`` and ``cnn_bn`` on Fashion-MNIST start with a 5×5 convolution of one input channel into
6 or 10 filters, ~30 % of either model's FLOPs; ``cnn_bn``'s second one (10 → 20 channels,
12×12 → 8×8) is another two thirds. oneDNN runs the first at 3.7–7.4× its FLOP floor on this CPU
whichever way it is asked (docs/benchmarks.md, ``benchmarks/conv_floor.py``): with one input
channel its inner product is 25 long, too short for a GEMM; the second, with 20 filters, leaves
most of a GEMM's vector lanes empty. Both write the whole output (4× what the pool keeps) before
the pool reads it back.

``conv_pool_cbN`` computes such a convolution directly, its pool in registers: one vector holds
two output rows of 8 columns. For each block of 8 output columns the image is first copied as K
column-shifted views (in L1), where two rows of one shift are 16 consecutive floats; four row
pairs times N filters (N = 4, 5 or 6, whichever pads the filters least) are 4N accumulators, 4
loads and N broadcasts per 4N fused multiply-adds; a BatchNorm's affine map and the ReLU after
the pool are applied before the quarter is written. The last column block and the last group of
four pooled rows overlap the ones before them where the size is not a multiple, so the kernel
takes a shape only where that recomputes at most 35 % (``cnn_bn``'s two convolutions, none;
LeNet-5's first on 28×28, 31 %; a digits CNN's first, none; not LeNet-5's second, 10×10, where
oneDNN is already near its floor).

Filters are padded with zeros to the block. The sums run in another order than oneDNN's
and with fused multiply-adds: the outputs agree with ``F.conv2d`` → ``max_pool2d`` to float
rounding (≤ 8e-6 absolute on unit-normal inputs), not bit for bit; a row's result does not depend
on its chunk or the thread count. The maximum propagates NaN as ``torch.maximum`` does. Compiled
once per machine as :mod:`flockfl.engine.fused`'s kernels are; with ``FLOCKFL_CONV_KERNEL=off``,
no C compiler, another shape, or anything but float32 CPU tensors without gradients,
:func:`conv_pool` returns None and the caller runs the convolution as before.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from flockfl.engine.fused import Kernels, split_rows

ENV = "FLOCKFL_CONV_KERNEL"
BLOCKS = (6, 5, 4)  # the kernels' numbers of filters computed together
WASTE = 1.35  # the most recomputation (overlapping blocks) a shape may cost to take the kernel

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline v16 vmax(v16 a, v16 b) { const v16i m = (a > b) | (a != a); return (v16)((m & (v16i)a) | (~m & (v16i)b)); }

/* The valid KxK convolution (stride 1) plus bias of x [n,Ci,H,W] with w [Cp,Ci,K,K], b [Cp] (Cp a
   multiple of CB, zero filters past Co), then the 2x2 maximum (floor mode): y [n,Co,oh,ow] with
   oh = (H-K+1)/2 >= 4, ow = (W-K+1)/2 >= 4. A vector holds two output rows of 8 columns. For each
   block of 8 output columns the image is first copied as K column-shifted views
   s[kx][ci][r][0..8] = x[ci][r][c8+kx .. c8+kx+8] (in L1), where rows r and r+1 of one shift are
   16 consecutive floats; 4 row pairs times CB filters are 4*CB accumulators: 4 loads and CB
   broadcasts per 4*CB fused multiply-adds. The last column block and the last group of 4 pooled
   rows overlap the ones before them where the size is not a multiple. Then, where given, each
   filter's affine map v*scale+shift (scale, shift [Cp]) and the ReLU (relu != 0; NaN stays NaN).
   Returns 0, or 1 when out of memory. */
#define DEFINE(CB) \
int conv_pool_cb##CB(int64_t n, int64_t Ci, int64_t H, int64_t W, int64_t K, int64_t Co, \
                     const float *x, const float *w, const float *b, const float *scale, const float *shift, \
                     int relu, float *y) \
{ \
    const int64_t oh = (H - K + 1) / 2, ow = (W - K + 1) / 2, we = 2 * ow, KK = K * K; \
    const v16i ev = {0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14}, od = ev + 1; \
    const v16i hi = {8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15}; \
    float *s = malloc((size_t)(K * Ci * H * 8) * sizeof(float)); \
    float out[16]; \
    if (!s) return 1; \
    for (int64_t i = 0; i < n; i++) { \
        const float *xi = x + i * Ci * H * W; \
        for (int64_t cx = 0; cx < we; cx += 8) { \
            const int64_t c8 = cx + 8 <= we ? cx : we - 8; /* output columns c8..c8+7; the last block overlaps */ \
            for (int64_t kx = 0; kx < K; kx++) \
                for (int64_t ci = 0; ci < Ci; ci++) \
                    for (int64_t r = 0; r < H; r++) \
                        memcpy(s + ((kx * Ci + ci) * H + r) * 8, xi + (ci * H + r) * W + c8 + kx, 8 * sizeof(float)); \
            for (int64_t c0 = 0; c0 < Co; c0 += CB) { \
                for (int64_t g = 0; g < oh; g += 4) { \
                    const int64_t g0 = g + 4 <= oh ? g : oh - 4; \
                    v16 acc[CB][4]; \
                    for (int q = 0; q < CB; q++) for (int j = 0; j < 4; j++) acc[q][j] = (v16){0} + b[c0 + q]; \
                    for (int64_t ci = 0; ci < Ci; ci++) \
                        for (int64_t ky = 0; ky < K; ky++) \
                            for (int64_t kx = 0; kx < K; kx++) { \
                                const float *sp = s + ((kx * Ci + ci) * H + 2 * g0 + ky) * 8; \
                                v16 u[4]; \
                                for (int j = 0; j < 4; j++) u[j] = load(sp + 16 * j); \
                                for (int q = 0; q < CB; q++) { \
                                    const float wq = w[((c0 + q) * Ci + ci) * KK + ky * K + kx]; \
                                    for (int j = 0; j < 4; j++) acc[q][j] += wq * u[j]; \
                                } \
                            } \
                    for (int q = 0; q < CB && c0 + q < Co; q++) \
                        for (int j = 0; j < 4; j++) { \
                            const v16 r = vmax(acc[q][j], __builtin_shuffle(acc[q][j], hi)); \
                            v16 m = vmax(__builtin_shuffle(r, ev), __builtin_shuffle(r, od)); \
                            if (scale) m = m * scale[c0 + q] + shift[c0 + q]; \
                            if (relu) m = vmax(m, (v16){0}); \
                            memcpy(out, &m, sizeof m); \
                            memcpy(y + ((i * Co + c0 + q) * oh + g0 + j) * ow + c8 / 2, out, 4 * sizeof(float)); \
                        } \
                } \
            } \
        } \
    } \
    free(s); \
    return 0; \
}
DEFINE(4)
DEFINE(5)
DEFINE(6)
"""
# fused multiply-adds (contracted): this kernel is not held to eager PyTorch's bits
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-fast-math", "-shared", "-fPIC"]



def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for cb in BLOCKS:
        fn = getattr(lib, f"conv_pool_cb{cb}")
        fn.argtypes = [i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int


KERNELS = Kernels("conv_pool", _SOURCE, _FLAGS, ENV, _declare)


def available() -> bool:
    """Whether the kernels can run here (compiled on first use; off with ``FLOCKFL_CONV_KERNEL=off``)."""
    return KERNELS.available()


def fits(conv: nn.Conv2d, pool: tuple[int, int]) -> bool:
    """Whether ``conv`` followed by the ``pool`` max-pool may be one these kernels compute (the input's
    size decides at each call): a square kernel, stride and dilation 1, no groups, zero padding
    given as numbers, a 2×2 pool."""
    return (conv.groups == 1 and conv.kernel_size[0] == conv.kernel_size[1]
            and tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str) and pool == (2, 2))


def block(filters: int) -> int:
    """The kernel's filters per pass for ``filters`` filters: the one that pads them least (the larger on a tie)."""
    return min(BLOCKS, key=lambda cb: (-(-filters // cb) * cb, -cb))


def waste(out_h: int, out_w: int) -> float:
    """How much more than the convolution's outputs the kernel computes on an ``out_h``×``out_w``
    output (blocks of 8 columns and of 8 rows, the last of each overlapping)."""
    return (-(-out_w // 8) * 8 / out_w) * (-(-(out_h // 2) // 4) * 4 / (out_h // 2))


def conv_pool(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              padding: tuple[int, int] = (0, 0), scale: Optional[torch.Tensor] = None,
              shift: Optional[torch.Tensor] = None, relu: bool = False) -> Optional[torch.Tensor]:
    """``max_pool2d(conv2d(x, weight, bias, padding=padding), 2)`` of ``x`` [N, C_in, H, W] and a square
    ``weight`` [C, C_in, K, K], then, where given, ``· scale + shift`` per filter and the ReLU, to
    float rounding, where the kernel takes the shape: an output at least 8×8 whose blocks recompute
    at most :data:`WASTE`; None otherwise (and for what the module's docstring lists), and the
    caller computes it as before."""
    if x.dim() != 4 or weight.dim() != 4 or x.shape[1] != weight.shape[1] or weight.shape[2] != weight.shape[3]:
        return None
    tensors = [t for t in (x, weight, bias, scale, shift) if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.requires_grad for t in tensors):
        return None
    ph, pw = padding
    n, ci, k, c = x.shape[0], x.shape[1], weight.shape[2], weight.shape[0]
    h, w = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw
    out_h, out_w = h - k + 1, w - k + 1
    if n == 0 or out_h < 8 or out_w < 8 or waste(out_h, out_w) > WASTE or not available():
        return None
    if ph or pw:
        x = nn.functional.pad(x, (pw, pw, ph, ph))
    x = x.contiguous()
    cb = block(c)
    cp = -(-c // cb) * cb
    wp = weight.new_zeros(cp, ci * k * k)
    wp[:c] = weight.reshape(c, -1)
    bp = weight.new_zeros(cp)
    if bias is not None:
        bp[:c] = bias
    sc = sh = None
    if scale is not None:
        sc, sh = weight.new_zeros(cp), weight.new_zeros(cp)
        sc[:c], sh[:c] = scale.reshape(-1), shift.reshape(-1)
    oh, ow = out_h // 2, out_w // 2
    y = x.new_empty(n, c, oh, ow)
    kernel, failed = getattr(KERNELS.lib, f"conv_pool_cb{cb}"), []

    def run(lo: int, hi: int) -> None:
        if kernel(hi - lo, ci, h, w, k, c, x.data_ptr() + lo * ci * h * w * 4, wp.data_ptr(), bp.data_ptr(),
                  None if sc is None else sc.data_ptr(), None if sh is None else sh.data_ptr(), int(relu),
                  y.data_ptr() + lo * c * oh * ow * 4):
            failed.append(lo)

    split_rows(run, n, ci * h * w * c)
    return None if failed else y
