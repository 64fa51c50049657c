"""The vectorised trainer's SGD update in one pass over memory, bit for bit eager PyTorch's.

A stacked cohort's local step ends with element-wise passes over every client's weights: weight
decay ω·w, FedProx's μ(w − anchor), SCAFFOLD's correction, the masks, then ``w − rate·g``. Eager
PyTorch runs each as its own pass over the cohort-sized tensors (W1: 120 clients' 784×200
weights, 75 MB a copy, ~14 passes a step), which made FedProx's and SCAFFOLD's rounds
memory-bound (docs/benchmarks.md). :func:`sgd_update` does them in one pass, block by block in L1,
with the same float32 operations in the same order, each rounded (no fused multiply-add:
``-ffp-contract=off``): the results are eager's bits, so nothing recorded changes.

The kernel is a few lines of C compiled once per machine with the system's C compiler into
``$XDG_CACHE_HOME/flockfl/kernels/`` (else ``~/.cache/...``; ~0.3 s) and called through ctypes,
which releases the interpreter lock (with more than one torch thread the rows are split over
threads). Where there is no compiler, the tensors are not float32 on the CPU, or
``FLOCKFL_FUSED_UPDATE=off``, :func:`available` is false and the trainer takes the eager path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from flockfl.cachedir import cache_dir, switched_off
from flockfl.engine.runtime import in_threads

ENV = "FLOCKFL_FUSED_UPDATE"

_SOURCE = r"""
#include <stdint.h>
#define BLOCK 1024

/* One client row after another, BLOCK elements at a time (in L1): x = g, then each term in
   eager's order, each operation rounded to float (the compiler is told not to contract). */
void sgd_update(int64_t rows, int64_t n, float *p, const float *g,
                int has_wd, float wd,
                const float *anchor, int64_t anchor_rs, const float *mu, int64_t mu_rs,
                const float *corr, int64_t corr_rs,
                const float *cmask,
                const float *emask, int64_t emask_rs,
                float rate)
{
    float x[BLOCK];
    for (int64_t i = 0; i < rows; i++) {
        float *pr = p + i * n;
        const float *gr = g + i * n;
        const float *ar = anchor ? anchor + i * anchor_rs : 0;
        const float m = anchor ? mu[i * mu_rs] : 0.0f;
        const float *cr = corr ? corr + i * corr_rs : 0;
        const float c = cmask ? cmask[i] : 1.0f;
        const float *er = emask ? emask + i * emask_rs : 0;
        for (int64_t b = 0; b < n; b += BLOCK) {
            const int64_t e = n - b < BLOCK ? n - b : BLOCK;
            for (int64_t j = 0; j < e; j++) x[j] = gr[b + j];
            if (has_wd) for (int64_t j = 0; j < e; j++) { float t = wd * pr[b + j]; x[j] = x[j] + t; }
            if (ar) for (int64_t j = 0; j < e; j++) { float t = pr[b + j] - ar[b + j]; t = t * m; x[j] = x[j] + t; }
            if (cr) for (int64_t j = 0; j < e; j++) x[j] = x[j] + cr[b + j];
            if (cmask) for (int64_t j = 0; j < e; j++) x[j] = x[j] * c;
            if (er) for (int64_t j = 0; j < e; j++) x[j] = x[j] * er[b + j];
            for (int64_t j = 0; j < e; j++) { float u = x[j] * rate; pr[b + j] = pr[b + j] - u; }
        }
    }
}

/* SCAFFOLD's new control variates (option II) and their change, in the aggregation's order:
   ci = (old - c) + (x - y) * scale, d = ci - old; x and c one row for every client. */
void scaffold_control(int64_t rows, int64_t n, const float *x, const float *y, const float *old,
                      const float *c, const float *scale, float *ci, float *d)
{
    for (int64_t i = 0; i < rows; i++) {
        const float s = scale[i];
        const float *yr = y + i * n, *orow = old + i * n;
        float *cr = ci + i * n, *dr = d + i * n;
        for (int64_t j = 0; j < n; j++) {
            float m = x[j] - yr[j];
            m = m * s;
            float t = orow[j] - c[j];
            t = t + m;
            cr[j] = t;
            dr[j] = t - orow[j];
        }
    }
}
"""
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]

def _machine() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def compile_library(stem: str, source: str, flags: list[str]) -> "ctypes.CDLL | bool":
    """``source`` compiled with the system's C compiler and ``flags`` into the kernel cache (once per
    source, compiler, flags and CPU) and loaded; False where there is no compiler or it fails."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return False
    key = hashlib.sha256("\n".join([source, cc, *flags, _machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{stem}-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(source)
                subprocess.run([cc, *flags, "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
                os.replace(out, path)  # atomic: a concurrent run reads the old file or the whole new one
        except (OSError, subprocess.SubprocessError):
            return False
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return False


class Kernels:
    """A C library compiled on first use (:func:`compile_library`), its functions declared by
    ``declare(lib)``, unless the environment variable ``env`` says off. One build a process,
    whichever thread asks first; a forked child gets a new build lock (it has none of its
    parent's threads: a lock one of them held would stay held)."""

    def __init__(self, stem: str, source: str, flags: list[str], env: str, declare: Callable[[ctypes.CDLL], None]):
        self.stem, self.source, self.flags, self.env, self.declare = stem, source, flags, env, declare
        self.lib: "ctypes.CDLL | bool | None" = None  # None: not tried yet; False: unavailable
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the library can run here (compiled on first use; off with ``<env>=off``)."""
        if switched_off(os.environ.get(self.env)):
            return False
        if self.lib is None:
            with self._lock:
                if self.lib is None:
                    lib = compile_library(self.stem, self.source, self.flags)
                    if lib is not False:
                        self.declare(lib)
                    self.lib = lib
        return self.lib is not False


def _declare(lib: ctypes.CDLL) -> None:
    f, i64, i32, ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.sgd_update.argtypes = [i64, i64, ptr, ptr, i32, f, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, f]
    lib.sgd_update.restype = None
    lib.scaffold_control.argtypes = [i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.scaffold_control.restype = None


KERNELS = Kernels("sgd_update", _SOURCE, _FLAGS, ENV, _declare)


def available() -> bool:
    """Whether the fused update can run here (compiled on first use; off with ``FLOCKFL_FUSED_UPDATE=off``)."""
    return KERNELS.available()


def _rows(t: Optional[torch.Tensor], p: torch.Tensor) -> tuple[Optional[torch.Tensor], int]:
    """``t`` as float32 rows of ``p``'s row length and its row stride: ``n`` (one row per client)
    or 0 (one row for every client); None if ``t`` is None."""
    if t is None:
        return None, 0
    rows, n = p.shape[0], p[0].numel()
    t = t.to(torch.float32)
    if t.dim() == p.dim() and t.shape[0] == rows and t.shape[1:] == p.shape[1:]:
        if t.stride(0) == 0:  # a shared start, expanded
            return t[:1].contiguous().reshape(1, n), 0
        return t.contiguous().reshape(rows, n), n
    if t.shape == p.shape[1:] or (t.dim() == p.dim() and t.shape[0] == 1 and t.shape[1:] == p.shape[1:]):
        return t.contiguous().reshape(1, n), 0
    return t.expand_as(p).contiguous().reshape(rows, n), n


def supported(p: torch.Tensor, g: torch.Tensor) -> bool:
    return (p.device.type == "cpu" and p.dtype == torch.float32 and g.dtype == torch.float32 and p.dim() >= 1
            and p.is_contiguous() and g.shape == p.shape and available())


def sgd_update(p: torch.Tensor, g: torch.Tensor, rate: float, *, weight_decay: float = 0.0,
               anchor: Optional[torch.Tensor] = None, mu=None, correction: Optional[torch.Tensor] = None,
               client_mask: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> None:
    """``p -= rate · ((((g + ω·p) + (p − anchor)·μ) + correction) · client_mask · mask)`` in place, each
    term only where given, each operation rounded as eager PyTorch rounds it (``p`` contiguous float32
    on the CPU, stacked on the client axis; ``mu`` a float or one value per client; ``client_mask``
    one 0/1 value per client; ``mask`` and ``correction`` shaped as ``p`` or as one client's row).
    ``g`` is read, not written. Call only where :func:`supported`."""
    if not supported(p, g):
        raise ValueError("fused.sgd_update: needs contiguous float32 CPU tensors of one shape and the compiled "
                         "kernel (check fused.supported first)")
    rows, n = p.shape[0], p[0].numel()
    g = g.contiguous()
    a, a_rs = _rows(anchor, p)
    if a is not None:
        mu_t = (mu.to(torch.float32).reshape(-1).contiguous() if isinstance(mu, torch.Tensor)
                else torch.tensor([float(mu)], dtype=torch.float32))
        mu_rs = 1 if mu_t.numel() == rows and rows > 1 else 0
    else:
        mu_t, mu_rs = None, 0
    c, c_rs = _rows(correction, p)
    e, e_rs = _rows(mask, p)
    cm = None if client_mask is None else client_mask.to(torch.float32).reshape(-1).contiguous()

    def ptr(t: Optional[torch.Tensor], row: int = 0, rs: int = 0) -> Optional[int]:
        return None if t is None else t.data_ptr() + row * rs * 4

    def run(lo: int, hi: int) -> None:
        KERNELS.lib.sgd_update(hi - lo, n, ptr(p, lo, n), ptr(g, lo, n), int(bool(weight_decay)), float(weight_decay),
                        ptr(a, lo, a_rs), a_rs, ptr(mu_t, lo, mu_rs), mu_rs, ptr(c, lo, c_rs), c_rs,
                        ptr(cm, lo, 1), ptr(e, lo, e_rs), e_rs, float(rate))

    split_rows(run, rows, n)


def split_rows(run, rows: int, n: int) -> None:
    """``run(lo, hi)`` over row ranges (``n`` elements each), on torch's threads when it is worth it (ctypes lets go of
    the interpreter lock during each call)."""
    threads = torch.get_num_threads()
    if threads <= 1 or rows < 2 or rows * n < 1 << 18:
        run(0, rows)
        return
    bounds = [rows * i // threads for i in range(threads + 1)]
    in_threads(lambda b: run(*b), [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo])


def scaffold_control(x: torch.Tensor, y: torch.Tensor, old: torch.Tensor, c: torch.Tensor, scale: torch.Tensor
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """SCAFFOLD option II's ``c_i⁺ = (c_i − c) + (x − y_i)·scale_i`` and ``c_i⁺ − c_i`` for a cohort
    (``y``, ``old``: ``[C, *shape]``; ``x``, ``c``: ``shape``; ``scale``: one per client) in one pass,
    each operation rounded as the eager ones; None where it cannot run (the caller runs those)."""
    if not (available() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, y, old, c, scale))
            and y.shape == old.shape and y.shape[1:] == x.shape == c.shape and scale.numel() == y.shape[0]):
        return None
    rows, n = y.shape[0], x.numel()
    x, y, old, c = x.contiguous(), y.contiguous(), old.contiguous(), c.contiguous()
    scale = scale.reshape(-1).contiguous()
    ci, d = torch.empty_like(y), torch.empty_like(y)

    def run(lo: int, hi: int) -> None:
        off = lo * n * 4
        KERNELS.lib.scaffold_control(hi - lo, n, x.data_ptr(), y.data_ptr() + off, old.data_ptr() + off, c.data_ptr(),
                              scale.data_ptr() + lo * 4, ci.data_ptr() + off, d.data_ptr() + off)

    split_rows(run, rows, n)
    return ci, d
