"""The process's torch runtime, set up once before a run trains: the intra-op thread count
(:func:`resolve_threads`, :func:`configure_threads`), glibc keeping freed memory for reuse
(:func:`keep_freed_memory`), and the device of ``train.device`` with the CUDA numerics of
``train.fast_math`` (:func:`resolve_device`, :func:`configure_cuda`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from flockfl import faults


# the user's OMP_NUM_THREADS as this process started: a Dask LocalCluster's nannies set
# OMP_NUM_THREADS=1 in the *driver's* environment (for their workers) whenever they spawn one,
# and a later run of this process must not read that as the user's thread count (other bits)
USER_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")


def resolve_threads(threads: int = 0) -> int:
    """The intra-op thread count a run uses, without touching torch: ``train.threads`` when set;
    else ``OMP_NUM_THREADS`` (its first value; capped by ``FLOCKFL_MAX_THREADS``); else the cores
    this process may use, at most 4 and at most ``FLOCKFL_MAX_THREADS`` (``flockfl sweep
    --parallel N`` shares the cores). Never the machine's load, nor the core lease
    (``flockfl.cores``): the count changes the bits of some reductions."""
    if threads:
        return threads
    cap = _positive(os.environ.get("FLOCKFL_MAX_THREADS"))
    omp = _positive((USER_OMP_NUM_THREADS or "").split(",")[0])
    if omp:
        return min(omp, cap) if cap else omp
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cap or 4, 4, cores))


def _positive(text: str | None) -> int:
    try:
        n = int(str(text).strip())
    except ValueError:
        return 0
    return n if n > 0 else 0


def configure_threads(threads: int = 0) -> int:
    """Set torch's intra-op threads deliberately (:func:`resolve_threads`), and keep freed tensor
    memory for reuse (:func:`keep_freed_memory`).

    Measured (benchmarks/speed_table.py, 2-core CPU shared with other sessions): with another
    busy process, two threads were up to 70x slower than one on the plain loop and 6-20x on the
    W1 trainer (each small op waits for the descheduled second thread); on a quieter machine two
    threads were faster (W1 trainer 0.070 s a round vs 0.118 s at one). The default stays the cores: the
    thread count changes the bits of some reductions (the digest corpus, recorded at 2 threads,
    fails at 1), and a choice by load would make a run's bits depend on the load. flockfl runs on
    one machine take turns on the cores instead (``flockfl.cores``, docs/operations.md), and
    OpenMP's threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``, flows/env.py)."""
    n = resolve_threads(threads)
    torch.set_num_threads(n)
    keep_freed_memory()
    return n


_RETAIN = 1 << 30  # bytes of freed heap glibc may keep at the top before it returns memory to the OS


def keep_freed_memory() -> bool:
    """glibc only: serve large blocks from the heap and keep up to 1 GiB freed for reuse.

    By default glibc maps every block over 32 MB (a W1 cohort's stacked weights: 75 MB) on its
    own and unmaps it when freed, so each round page-faults its big tensors in afresh; on W1
    that was a quarter of the training stage. ``FLOCKFL_MALLOC=system`` leaves glibc as it is.
    Returns whether the setting was applied."""
    if os.environ.get("FLOCKFL_MALLOC") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters (malloc.h)
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, _RETAIN))
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False


def resolve_device(name: str, fast_math: bool = False) -> torch.device:
    """The torch device of ``train.device`` (auto: CUDA when available). On CUDA, also the
    numerics of ``train.fast_math`` (see :func:`configure_cuda`); CPU settings are untouched."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    else:
        device = torch.device(name)
    if device.type == "cuda":
        configure_cuda(fast_math)
    return device


_FAST_MATH_WARNED = [False]


def configure_cuda(fast_math: bool) -> None:
    """CUDA numerics for the whole process.

    ``fast_math=False`` (the default): no TF32 in matmuls or convolutions, cuDNN's
    deterministic algorithms without autotuning, and ``torch.use_deterministic_algorithms``
    (cuBLAS gets a fixed workspace through ``CUBLAS_WORKSPACE_CONFIG``, set when
    :mod:`flockfl.engine` is imported). A run then repeats bit for bit on the same GPU and
    software, so a resumed run equals a straight one, and it matches a CPU run up to float
    rounding (every random draw is made on the CPU). ``fast_math=True``: TF32 and cuDNN
    autotuning, nondeterministic kernels allowed: faster, but bit-identity is given up
    (a warning says so once)."""
    torch.backends.cuda.matmul.allow_tf32 = fast_math
    torch.backends.cudnn.allow_tf32 = fast_math
    torch.backends.cudnn.benchmark = fast_math
    torch.backends.cudnn.deterministic = not fast_math
    torch.use_deterministic_algorithms(not fast_math)
    if fast_math and not _FAST_MATH_WARNED[0]:
        _FAST_MATH_WARNED[0] = True
        warnings.warn("train.fast_math=true: TF32 and nondeterministic CUDA kernels; runs (and resumed runs) are no "
                      "longer bit-identical, and differ from CPU runs by more than float rounding", RuntimeWarning,
                      stacklevel=3)


_pool: "ThreadPoolExecutor | None" = None
_pool_lock = threading.Lock()


def in_threads(fn, items) -> list:
    """``[fn(x) for x in items]`` on torch's intra-op thread count, in order, the first error raised:
    for work that lets go of the interpreter lock (ctypes calls, hashing, file reads). One pool a
    process, made again in a forked child (the resident's commands), which has none of its
    parent's threads: a pool copied from the parent would take work and never run it."""
    global _pool
    items = list(items)
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="flockfl")
        pool = _pool
    return list(pool.map(fn, items))


_lanes: dict[str, ThreadPoolExecutor] = {}


def in_background(fn, *args, lane: str = "digests"):
    """``fn(*args)`` on the process's background thread for ``lane``, in the order submitted there;
    returns its future. For work that the caller needs later, not now: a round's new client-table
    rows hashed while the round evaluates (``digests``), its checkpoint written while the next
    round runs (``checkpoints``). One thread a lane, so a lane's work waits only for its own;
    made again in a forked child, as :func:`in_threads`'s pool."""
    with _pool_lock:
        if lane not in _lanes:
            _lanes[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"flockfl-{lane}")
        pool = _lanes[lane]
    return pool.submit(fn, *args)


def drain_background() -> None:
    """Wait for the work submitted to every background lane so far (but the calling thread's own
    lane, which would wait for itself)."""
    with _pool_lock:
        lanes = dict(_lanes)
    me = threading.current_thread().name
    for lane, pool in lanes.items():
        if not me.startswith(f"flockfl-{lane}"):
            pool.submit(lambda: None).result()


faults.BEFORE_KILL.append(drain_background)  # a crash drill's point comes after the work in flight


def _after_fork() -> None:
    global _pool, _pool_lock, _lanes
    _pool, _pool_lock, _lanes = None, threading.Lock(), {}


os.register_at_fork(after_in_child=_after_fork)
