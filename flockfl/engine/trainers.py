"""The two local trainers: a plain per-client reference loop and the vectorised cohort trainer.

Both take a :class:`LocalSpec` and the materialised client data, follow the same batch
schedule, and return a :class:`TrainResult`. Tests assert that they agree to 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from flockfl.engine.data import Split
from flockfl.engine.dense import DenseCohort, dense_layers
from flockfl.engine.functional import per_sample_loss, stack, stacked_plan, stacked_step
from flockfl.engine.schedule import LocalSpec, cohort_schedule, restrict, stack_schedule


@dataclass
class TrainResult:
    clients: np.ndarray
    params: dict[str, torch.Tensor]  # stacked final parameters
    num_samples: np.ndarray  # n_i
    num_steps: np.ndarray  # local steps actually taken
    loss: np.ndarray  # mean training loss over the local steps
    meta: dict = field(default_factory=dict)

    @staticmethod
    def concat(parts: list["TrainResult"]) -> "TrainResult":
        parts = [p for p in parts if len(p.clients)]
        if len(parts) == 1:
            return parts[0]
        meta: dict = {}
        for p in parts:
            for k, v in p.meta.items():
                meta.setdefault(k, []).append(v)
        return TrainResult(
            np.concatenate([p.clients for p in parts]),
            {k: torch.cat([p.params[k] for p in parts]) for k in parts[0].params},
            np.concatenate([p.num_samples for p in parts]),
            np.concatenate([p.num_steps for p in parts]),
            np.concatenate([p.loss for p in parts]),
            {k: _concat_meta(v) for k, v in meta.items()},
        )


def _concat_meta(parts: list):
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if isinstance(parts[0], dict):  # stacked tensors (the pruning snapshot, masks)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return parts


def solved(model: nn.Module, spec: LocalSpec, data: Split, task: str, vectorized: bool = False) -> TrainResult:
    """The result of a local solver (no steps, no training loss). A solver returns the stacked
    parameters, or (parameters, meta): stacked per-client extras (pFedMe's θ̃_i) that ride in
    ``TrainResult.meta`` and are concatenated across shards like the parameters. The vectorised
    trainer runs ``spec.solver_vectorized`` where the algorithm gives one (the same update for
    the whole cohort at once; tests hold it to the per-client ``spec.solver``)."""
    fn = spec.solver_vectorized if vectorized and spec.solver_vectorized is not None else spec.solver
    out = fn(model, spec, data, task)
    params, meta = out if isinstance(out, tuple) else (out, {})
    n = len(spec.clients)
    return TrainResult(np.asarray(spec.clients), params, data.sizes[spec.clients], np.zeros(n, np.int64), np.zeros(n),
                       dict(meta))


def stat_names(model: nn.Module) -> list[str]:
    """Entries of the parameter dict that are state, not trained (BN statistics), in the
    model's order: neither trainer steps them; :func:`calibrate_bn` sets them after training."""
    return [n for n, p in model.named_parameters() if not p.requires_grad]


@torch.no_grad()
def calibrate_bn(model: nn.Module, params: dict[str, torch.Tensor], data: Split, clients: np.ndarray) -> None:
    """"Precise BN": set each client's BN statistics (in place, row i for ``clients[i]``) to
    the exact mean and unbiased variance of each BN input over the client's whole training
    set, under its trained parameters. Shared by both trainers, so they agree."""
    bns = [n.rsplit(".", 1)[0] for n in stat_names(model) if n.endswith("running_mean")]  # in forward order
    if not bns:
        return
    with training(model):
        for i, cid in enumerate(clients):
            x_c, _ = data.client(int(cid))
            if len(x_c) == 0:
                continue
            record: list = []
            functional_call(model, {k: v[i] for k, v in params.items()}, (x_c,), {"record": record})
            for bn, (mean, var, count) in zip(bns, record):
                params[f"{bn}.running_mean"][i] = mean
                params[f"{bn}.running_var"][i] = var * (count / max(count - 1, 1))


@contextlib.contextmanager
def training(model: nn.Module):
    """The model in training mode for a block (BatchNorm on the batch's statistics), then back
    in the mode it was in (the driver keeps it in evaluation mode between rounds)."""
    was = model.training
    model.train()
    try:
        yield model
    finally:
        model.train(was)


def client_mask(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-client 0/1 flag (clients still stepping) as ``like``'s dtype, broadcast over the
    trailing dimensions of a tensor stacked on the client axis."""
    return active.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def _snapshot_at(spec: LocalSpec, steps_taken: np.ndarray) -> np.ndarray | None:
    """The step after which each client's snapshot is taken (its last step if it takes fewer)."""
    if spec.snapshot_steps is None:
        return None
    return np.minimum(np.asarray(spec.snapshot_steps), steps_taken)


def train_reference(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int, round: int) -> TrainResult:
    """Plain PyTorch: one model copy per client, SGD step by step."""
    if spec.solver is not None:
        return solved(model, spec, data, task)
    batches = cohort_schedule(spec, data.sizes, seed, round)
    frozen = stat_names(model)
    snap_at = _snapshot_at(spec, np.array([len(b) for b in batches]))
    finals, losses, snaps, buffers = [], [], [], []
    for ci, cid in enumerate(spec.clients):
        net = copy.deepcopy(model)
        net.train()
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(spec.init[name][ci])
        x_c, y_c = data.client(int(cid))
        anchor = {n: (spec.prox_anchor or spec.init)[n][ci] for n, _ in net.named_parameters()}
        buf = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
        if spec.momentum_init is not None:  # train.optimizer_state=persist: where the client's last round left it
            buf.update({n: spec.momentum_init[n][ci].to(buf[n]).clone() for n in spec.momentum_init})
        total = 0.0
        snap = {n: p.detach().clone() for n, p in net.named_parameters()} if snap_at is not None and snap_at[ci] == 0 else None
        rates = spec.step_rates(round, len(batches[ci]))
        stepped = [(n, p) for n, p in net.named_parameters() if n not in frozen]  # once per client, not per step
        after = bool(spec.momentum) and spec.correction_after_momentum  # where the correction enters
        for s, local in enumerate(batches[ci]):
            idx = torch.from_numpy(local)
            net.zero_grad(set_to_none=True)
            loss = per_sample_loss(net(x_c[idx]), y_c[idx], task).mean()
            loss.backward()
            with torch.no_grad():
                for n, p in stepped:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    if spec.weight_decay:
                        g = g + spec.weight_decay * p
                    if spec.mu_of(n):
                        g = g + spec.mu_of(n) * (p - anchor[n])
                    if spec.correction is not None and not after:
                        g = g + spec.correction[n][ci]
                    if spec.momentum:
                        buf[n] = spec.momentum * buf[n] + g
                        g = buf[n]
                    if spec.correction is not None and after:
                        g = g + spec.correction[n][ci]
                    if spec.masks is not None and n in spec.masks:
                        g = g * spec.masks[n][ci]
                    p.sub_(rates[s] * g)
            total += float(loss.detach())
            if snap_at is not None and s + 1 == snap_at[ci]:
                snap = {n: p.detach().clone() for n, p in net.named_parameters()}
        finals.append({n: p.detach().clone() for n, p in net.named_parameters()})
        if spec.momentum_init is not None:
            buffers.append({n: buf[n] for n in spec.momentum_init})
        if snap_at is not None:
            snaps.append(snap if snap is not None else finals[-1])
        losses.append(total / max(len(batches[ci]), 1))
    params = stack(finals)
    calibrate_bn(model, params, data, spec.clients)
    meta = {"snapshot": stack(snaps)} if snap_at is not None and snaps else {}
    if spec.momentum_init is not None:
        meta["momentum_buffer"] = stack(buffers) if buffers else {k: v.clone() for k, v in spec.momentum_init.items()}
    return TrainResult(
        np.asarray(spec.clients), params, data.sizes[spec.clients],
        np.array([len(b) for b in batches]), np.array(losses), meta,
    )


def train_cohort(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int, round: int,
                 method: str = "auto") -> TrainResult:
    """All clients at once: parameters stacked on a leading axis, one batched step for all.

    ``method``: ``dense`` (hand-written in-place step for Linear/ReLU stacks, see
    :mod:`flockfl.engine.dense`), ``func`` (``vmap(grad)`` of ``functional_call``, any
    model), or ``auto`` (dense where the model allows it). Clients of unequal size are
    handled as data: padded batch slots have weight 0 and a client with no step left gets
    a zero gradient.
    """
    if spec.solver is not None:
        return solved(model, spec, data, task, vectorized=True)
    sched = stack_schedule(cohort_schedule(spec, data.sizes, seed, round), data.offsets, spec.clients)
    device = data.x.device
    rates = spec.step_rates(round, sched.steps)  # step s's rate, the same for every client still stepping
    # the dense trainer takes plain SGD steps with one η for the whole pass
    plain = not spec.has_extras and spec.masks is None and spec.snapshot_steps is None and len(set(rates)) <= 1
    layers = dense_layers(model) if method in ("auto", "dense") and plain else None
    steps = sched.active.sum(0).numpy()
    if method == "dense" and layers is None:
        raise ValueError("method='dense' needs a Flatten/Linear/ReLU stack, a constant rate within the pass and no "
                         "prox/correction/momentum/weight-decay/mask/snapshot terms")
    snap_at = _snapshot_at(spec, steps)
    meta: dict = {}
    index, weight = sched.index.to(device), sched.weight.to(device)
    total = torch.zeros(len(spec.clients), device=device)
    if layers is not None:
        # keep broadcast inits broadcast (a shared start enables the low-rank layers)
        init = {k: (v[:1].to(device).expand_as(v) if v.stride(0) == 0 else v.to(device)) for k, v in spec.init.items()}
        cohort = DenseCohort(init, layers, rates[0] if rates else spec.lr, index.shape[2])
        for s in range(sched.steps):
            total += cohort.step(data.x[index[s]], data.y[index[s]], weight[s], task)
        params = cohort.params()
    else:
        params = {k: v.to(device).clone(memory_format=torch.contiguous_format) for k, v in spec.init.items()}
        frozen = stat_names(model)
        step = cohort_step(model, task, method)
        extras = _GradientTerms(spec, params, device)
        masks = {k: v.to(device) for k, v in spec.masks.items()} if spec.masks is not None else {}
        snap = {k: v.clone() for k, v in params.items()} if snap_at is not None else None
        with training(model):
            for s in range(sched.steps):
                g, loss = step(params, data.x[index[s]], data.y[index[s]], weight[s])
                with torch.no_grad():
                    if extras.any:
                        g = extras.apply(params, g, sched.active[s].to(device))
                    for k in params:
                        if k in frozen:
                            continue
                        gk = g[k] * masks[k] if k in masks else g[k]
                        params[k] = params[k] - rates[s] * gk
                    if snap is not None:
                        rows = torch.from_numpy(np.flatnonzero(snap_at == s + 1)).to(device)
                        if len(rows):
                            for k in params:
                                snap[k][rows] = params[k][rows]
                total += loss.detach()
        calibrate_bn(model, params, data, spec.clients)
        if snap is not None:
            meta["snapshot"] = snap
    if spec.momentum_init is not None:  # persist: each client's final buffer (its start, where it takes no momentum)
        buf = extras.buf if layers is None and extras.buf is not None else None
        meta["momentum_buffer"] = {k: buf[k] if buf is not None else spec.momentum_init[k].to(device).clone()
                                   for k in spec.momentum_init}
    return TrainResult(
        np.asarray(spec.clients), params, data.sizes[spec.clients], steps,
        (total.cpu().numpy() / np.maximum(steps, 1)), meta,
    )


def cohort_step(model: nn.Module, task: str, method: str = "auto"):
    """``step(params, x, y, w) → (gradients, losses)`` for parameters stacked on a leading client
    axis and a [C, B] batch with per-sample weights ``w`` (1/batch size, 0 for padding): the
    stacked convolution plan where the model has one (``auto``/``stacked``), else ``vmap`` of
    ``grad_and_value`` over ``functional_call``. BN statistics are taken over the real samples
    only; frozen entries (BN statistics) get a zero gradient (stacked) or their autograd one,
    which the callers never apply."""
    frozen = stat_names(model)
    weighted = getattr(model, "takes_sample_weight", False)  # BN: batch statistics over real samples only

    def weighted_loss(p, x, y, w):
        out = functional_call(model, p, (x,), {"sample_weight": w}) if weighted else functional_call(model, p, (x,))
        return (per_sample_loss(out, y, task) * w).sum()

    plan = stacked_plan(model) if method in ("auto", "stacked") else None
    if method == "stacked" and plan is None:
        raise ValueError("method='stacked' needs a Sequential of Conv2d/ReLU/MaxPool2d/Flatten/Linear or a ConvBNNet")
    return stacked_step(model, plan, task, frozen) if plan is not None else vmap(grad_and_value(weighted_loss))


class _GradientTerms:
    """Weight decay ω·w, FedProx's μ(w − anchor), an additive per-client correction and local
    momentum, in the reference loop's order, for stacked parameters. Clients with no step left
    (``active`` false) neither move nor advance their momentum."""

    def __init__(self, spec: LocalSpec, params: dict[str, torch.Tensor], device):
        self.spec = spec
        self.any = spec.has_extras
        self.anchor = {k: v.to(device) for k, v in (spec.prox_anchor or spec.init).items()} if spec.has_prox else None
        self.corr = {k: v.to(device) for k, v in spec.correction.items()} if spec.correction is not None else None
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()} if spec.momentum else None
        if self.buf is not None and spec.momentum_init is not None:  # persist: each client's buffer from its last round
            self.buf.update({k: v.to(device, params[k].dtype).clone() for k, v in spec.momentum_init.items()})
        self.after = self.buf is not None and spec.correction_after_momentum  # where the correction enters

    def apply(self, params, g, active):
        out = {}
        for k, gk in g.items():
            mask = client_mask(active, gk)
            if self.spec.weight_decay:
                gk = gk + self.spec.weight_decay * params[k]
            if self.anchor is not None and self.spec.mu_of(k):
                gk = gk + self.spec.mu_of(k) * (params[k] - self.anchor[k])
            if self.corr is not None and not self.after:
                gk = gk + self.corr[k]
            if self.buf is not None:
                self.buf[k] = mask * (self.spec.momentum * self.buf[k] + gk) + (1 - mask) * self.buf[k]
                gk = self.buf[k]
            if self.corr is not None and self.after:
                gk = gk + self.corr[k]
            out[k] = gk * mask
        return out


TRAINERS = {"reference": train_reference, "vectorized": train_cohort}


def choose_engine(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int) -> tuple[str, dict]:
    """Time both trainers on this cohort and return the faster one with the timings.

    The reference path is timed on up to 3 clients and scaled to the cohort. The vectorised
    path costs a fixed part (schedule, BN calibration over every client's data, results) plus
    a part per step: it is timed on the whole cohort for 1 and for 1 + k steps (k ≤ 16, each
    the faster of two tries), and the line through the two is read at the schedule's length
    (scaling a short run alone would multiply its fixed part by the steps). The per-step cost is
    a difference of two timings multiplied by the schedule's length, so its noise is what the
    span k and the two tries keep small: with k = 4 and one try, ±20 ms of noise in the fixed
    part moved a 100-step estimate by ±0.5 s and picked the slower trainer for ``cnn_bn`` in one
    run of two. The probes' results are discarded and they draw from their own RNG purpose.
    """
    probe_round = 2**31 - 2  # a round index no real run reaches, so the probe draws its own data orders
    n = len(spec.clients)
    few = min(3, n)
    sub = restrict(spec, np.arange(few))
    t0 = time.perf_counter()
    train_reference(model, sub, data, task, seed, probe_round)
    ref = (time.perf_counter() - t0) / few * n
    steps = max(len(b) for b in cohort_schedule(spec, data.sizes, seed, probe_round))

    def vectorized(k: int) -> float:
        short = dataclasses.replace(spec, epochs=1, steps=k, client_epochs=None, client_steps=None)
        t0 = time.perf_counter()
        train_cohort(model, short, data, task, seed, probe_round)
        return time.perf_counter() - t0

    vectorized(1)  # warm-up (the first vmap call traces, the first convolution picks its kernel)
    k = min(16, steps - 1)
    one = min(vectorized(1), vectorized(1))
    per_step = max(min(vectorized(1 + k), vectorized(1 + k)) - one, 0.0) / k if k > 0 else 0.0
    vec = one + per_step * (steps - 1)
    choice = "vectorized" if vec <= ref else "reference"
    return choice, {"reference_s_est": ref, "vectorized_s_est": vec, "vectorized_step_s": per_step}


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
