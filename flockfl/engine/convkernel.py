"""The first convolution of a one-channel image and its 2×2 max-pool in one kernel (evaluation).

``lenet5`` and ``cnn_bn`` on Fashion-MNIST start with a 5×5 convolution of one input channel into
6 or 10 filters, ~30 % of either model's FLOPs. oneDNN runs it at 3.7–7.4× its FLOP floor on this
CPU whichever way it is asked (docs/benchmarks.md, ``benchmarks/conv_floor.py``): with one input
channel its inner product is 25 long, too short for a GEMM, and its output (4× what the pool
keeps) goes through memory before the pool reads it back.

:func:`conv_pool` computes it directly: a strip of 16 output columns of two output rows is one
vector register per row, four filters at once share each input load (8 accumulators, 2 loads and
4 broadcasts per 8 fused multiply-adds), and the 2×2 maximum is taken in registers, so only the
pooled quarter is written. The last strip of a row overlaps the one before it when the width is
not a multiple of 16; filters are padded with zeros to a multiple of four.

Its sums run in another order than oneDNN's and with fused multiply-adds: its outputs agree with
``F.conv2d`` → ``max_pool2d`` to float rounding (measured ≤ 8e-6 absolute on unit-normal inputs),
not bit for bit. The maximum propagates NaN as ``torch.maximum`` does. Compiled once per machine
as :mod:`flockfl.engine.fused`'s kernels are; ``FLOCKFL_CONV_KERNEL=off``, no C compiler, a pooled
row narrower than 8, or anything but float32 CPU tensors without gradients: :func:`conv_pool`
returns None and the caller runs the convolution as before.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch
from torch import nn

from flockfl.engine.fused import compile_library, split_rows

ENV = "FLOCKFL_CONV_KERNEL"
CB = 4  # filters computed together
STRIP = 16  # output columns a vector holds

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
/* the larger of a and b, a where a is NaN (as torch.maximum: NaN wins) */
static inline v16 vmax(v16 a, v16 b) { const v16i m = (a > b) | (a != a); return (v16)((m & (v16i)a) | (~m & (v16i)b)); }

/* x [n,H,W] (one channel); w [Cp,K,K], b [Cp] with Cp a multiple of 4 (zero filters past C);
   y [n,C,oh,ow] with oh = (H-K+1)/2, ow = (W-K+1)/2 and 2*ow >= 16: the valid KxK convolution
   (stride 1) of every image with every filter, plus its bias, then the 2x2 maximum (floor mode) */
void conv1_pool2(int64_t n, int64_t H, int64_t W, int64_t K, int64_t C,
                 const float *x, const float *w, const float *b, float *y)
{
    const int64_t oh = (H - K + 1) / 2, ow = (W - K + 1) / 2, we = 2 * ow, KK = K * K;
    const v16i ev = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, od = ev + 1;
    float out[4][16];
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * H * W;
        for (int64_t c0 = 0; c0 < C; c0 += 4) {
            const float *wc = w + c0 * KK;
            for (int64_t py = 0; py < oh; py++) {
                for (int64_t s = 0; s < we; s += 16) {
                    const int64_t sx = s + 16 <= we ? s : we - 16;  /* the last strip overlaps */
                    v16 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
                    a00 += b[c0]; a01 += b[c0]; a10 += b[c0 + 1]; a11 += b[c0 + 1];
                    a20 += b[c0 + 2]; a21 += b[c0 + 2]; a30 += b[c0 + 3]; a31 += b[c0 + 3];
                    for (int64_t ky = 0; ky < K; ky++) {
                        const float *r0 = xi + (2 * py + ky) * W + sx, *r1 = r0 + W, *wk = wc + ky * K;
                        for (int64_t kx = 0; kx < K; kx++) {
                            const v16 u0 = load(r0 + kx), u1 = load(r1 + kx);
                            const float w0 = wk[kx], w1 = wk[KK + kx], w2 = wk[2 * KK + kx], w3 = wk[3 * KK + kx];
                            a00 += w0 * u0; a01 += w0 * u1;
                            a10 += w1 * u0; a11 += w1 * u1;
                            a20 += w2 * u0; a21 += w2 * u1;
                            a30 += w3 * u0; a31 += w3 * u1;
                        }
                    }
                    /* rows first, then column pairs: two filters' 8 results in one vector */
                    const v16 m0 = vmax(a00, a01), m1 = vmax(a10, a11), m2 = vmax(a20, a21), m3 = vmax(a30, a31);
                    const v16 p01 = vmax(__builtin_shuffle(m0, m1, ev), __builtin_shuffle(m0, m1, od));
                    const v16 p23 = vmax(__builtin_shuffle(m2, m3, ev), __builtin_shuffle(m2, m3, od));
                    memcpy(out[0], &p01, sizeof p01);
                    memcpy(out[2], &p23, sizeof p23);
                    for (int q = 0; q < 4 && c0 + q < C; q++)
                        memcpy(y + ((i * C + c0 + q) * oh + py) * ow + sx / 2, &out[q & ~1][(q & 1) * 8], 8 * sizeof(float));
                }
            }
        }
    }
}
"""
# fused multiply-adds (contracted): this kernel is not held to eager PyTorch's bits
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-fast-math", "-shared", "-fPIC"]

_lock = threading.Lock()
_lib = None  # None: not tried yet; False: unavailable


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def available() -> bool:
    """Whether the kernel can run here (compiled on first use; off with ``FLOCKFL_CONV_KERNEL=off``)."""
    global _lib
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    if _lib is None:
        with _lock:
            if _lib is None:
                lib = compile_library("conv1_pool2", _SOURCE, _FLAGS)
                if lib is not False:
                    i64, ptr = ctypes.c_int64, ctypes.c_void_p
                    lib.conv1_pool2.argtypes = [i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
                    lib.conv1_pool2.restype = None
                _lib = lib
    return _lib is not False


def fits(conv: nn.Conv2d, pool: tuple[int, int]) -> bool:
    """Whether ``conv`` followed by the ``pool`` max-pool is one this kernel computes: one input
    channel, a square kernel, stride and dilation 1, no groups, zero padding given as numbers, a 2×2 pool."""
    return (conv.in_channels == 1 and conv.groups == 1 and conv.kernel_size[0] == conv.kernel_size[1]
            and tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str) and pool == (2, 2))


def conv_pool(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              padding: tuple[int, int] = (0, 0)) -> Optional[torch.Tensor]:
    """``max_pool2d(conv2d(x, weight, bias, padding=padding), 2)`` of a one-channel ``x`` [N, 1, H, W]
    and a square ``weight`` [C, 1, K, K], to float rounding; None where the kernel does not apply
    (see the module's docstring), and the caller computes it as before."""
    if x.dim() != 4 or x.shape[1] != 1 or weight.dim() != 4 or weight.shape[1] != 1 or weight.shape[2] != weight.shape[3]:
        return None
    tensors = [t for t in (x, weight, bias) if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.requires_grad for t in tensors):
        return None
    ph, pw = padding
    n, k, c = x.shape[0], weight.shape[2], weight.shape[0]
    h, w = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw
    oh, ow = (h - k + 1) // 2, (w - k + 1) // 2
    if n == 0 or oh < 1 or 2 * ow < STRIP or not available():
        return None
    if ph or pw:
        x = nn.functional.pad(x, (pw, pw, ph, ph))
    x = x.contiguous()
    cp = -(-c // CB) * CB
    wp = weight.new_zeros(cp, k * k)
    wp[:c] = weight.reshape(c, k * k)
    bp = weight.new_zeros(cp)
    if bias is not None:
        bp[:c] = bias
    y = x.new_empty(n, c, oh, ow)

    def run(lo: int, hi: int) -> None:
        _lib.conv1_pool2(hi - lo, h, w, k, c, x.data_ptr() + lo * h * w * 4, wp.data_ptr(), bp.data_ptr(),
                         y.data_ptr() + lo * c * oh * ow * 4)

    split_rows(run, n, h * w * c)
    return y
