"""The two local trainers: a plain per-client reference loop and the vectorised cohort trainer.

Both take a :class:`LocalSpec` and the materialised client data, follow the same batch
schedule, and return a :class:`TrainResult`. Tests assert that they agree to 1e-5.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from flockfl.data.clients import Split
from flockfl.engine.dense import DenseCohort, dense_layers
from flockfl.engine.functional import per_sample_loss, stack
from flockfl.engine.schedule import LocalSpec, cohort_schedule, stack_schedule


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
            {k: np.concatenate(v) if isinstance(v[0], np.ndarray) else v for k, v in meta.items()},
        )


def train_reference(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int, round: int) -> TrainResult:
    """Plain PyTorch: one model copy per client, SGD step by step."""
    batches = cohort_schedule(spec, data.sizes, seed, round)
    finals, losses = [], []
    for ci, cid in enumerate(spec.clients):
        net = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(spec.init[name][ci])
        x_c, y_c = data.client(int(cid))
        total = 0.0
        for local in batches[ci]:
            idx = torch.from_numpy(local)
            net.zero_grad(set_to_none=True)
            loss = per_sample_loss(net(x_c[idx]), y_c[idx], task).mean()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(spec.lr * p.grad)
            total += float(loss.detach())
        finals.append({n: p.detach().clone() for n, p in net.named_parameters()})
        losses.append(total / max(len(batches[ci]), 1))
    return TrainResult(
        np.asarray(spec.clients), stack(finals), data.sizes[spec.clients],
        np.array([len(b) for b in batches]), np.array(losses),
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
    sched = stack_schedule(cohort_schedule(spec, data.sizes, seed, round), data.offsets, spec.clients)
    device = data.x.device
    layers = dense_layers(model) if method in ("auto", "dense") else None
    if method == "dense" and layers is None:
        raise ValueError("method='dense' needs a Flatten/Linear/ReLU stack")
    index, weight = sched.index.to(device), sched.weight.to(device)
    total = torch.zeros(len(spec.clients), device=device)
    if layers is not None:
        # keep broadcast inits broadcast (a shared start enables the low-rank layers)
        init = {k: (v[:1].to(device).expand_as(v) if v.stride(0) == 0 else v.to(device)) for k, v in spec.init.items()}
        cohort = DenseCohort(init, layers, spec.lr, index.shape[2])
        for s in range(sched.steps):
            total += cohort.step(data.x[index[s]], data.y[index[s]], weight[s], task)
        params = cohort.params()
    else:
        params = {k: v.to(device).clone(memory_format=torch.contiguous_format) for k, v in spec.init.items()}

        def weighted_loss(p, x, y, w):
            return (per_sample_loss(functional_call(model, p, (x,)), y, task) * w).sum()

        step = vmap(grad_and_value(weighted_loss))
        for s in range(sched.steps):
            g, loss = step(params, data.x[index[s]], data.y[index[s]], weight[s])
            with torch.no_grad():
                for k in params:
                    params[k] = params[k] - spec.lr * g[k]
            total += loss.detach()
    steps = sched.active.sum(0).numpy()
    return TrainResult(
        np.asarray(spec.clients), params, data.sizes[spec.clients], steps,
        (total.cpu().numpy() / np.maximum(steps, 1)),
    )


TRAINERS = {"reference": train_reference, "vectorized": train_cohort}


def choose_engine(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int) -> tuple[str, dict]:
    """Time both trainers on this cohort and return the faster one with the timings.

    The reference path is timed on up to 3 clients and scaled to the cohort; the
    vectorised path on the whole cohort for up to 2 steps and scaled to the schedule.
    The probe's results are discarded and it draws from its own RNG purpose.
    """
    probe_round = 2**31 - 2  # a round index no real run reaches, so the probe draws its own data orders
    n = len(spec.clients)
    few = min(3, n)
    sub = LocalSpec(spec.clients[:few], {k: v[:few] for k, v in spec.init.items()}, spec.lr, spec.epochs,
                    spec.steps, spec.batch_size, spec.full_batch)
    t0 = time.perf_counter()
    train_reference(model, sub, data, task, seed, probe_round)
    ref = (time.perf_counter() - t0) / few * n
    steps = max(len(b) for b in cohort_schedule(spec, data.sizes, seed, probe_round))
    short = LocalSpec(spec.clients, spec.init, spec.lr, 1, min(2, steps), spec.batch_size, spec.full_batch)
    train_cohort(model, short, data, task, seed, probe_round)  # warm-up (first vmap call traces)
    t0 = time.perf_counter()
    train_cohort(model, short, data, task, seed, probe_round)
    vec = (time.perf_counter() - t0) / min(2, steps) * steps
    choice = "vectorized" if vec <= ref else "reference"
    return choice, {"reference_s_est": ref, "vectorized_s_est": vec}


def configure_threads(threads: int = 0) -> int:
    """Set torch's intra-op threads deliberately (0 = the cores we may use, at most 4)."""
    n = threads or max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    return torch.device(name)
