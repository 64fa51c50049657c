"""``train.engine=auto``'s probe: :func:`choose_engine` times both trainers of
:mod:`flockfl.engine.trainers` on a cohort and returns the faster one with the timings (the
round driver asks it once, on the first cohort, and keeps the choice).

:func:`cached_choice` keeps the verdicts on this machine (1.5-31 s a run measured here), keyed
by what the timings depend on: the model's architecture and parameter shapes, the data's
sample shape and device, the cohort's size, steps, batch and which extra terms its spec
carries, the threads, torch's version and the machine. The file is
``$XDG_CACHE_HOME/flockfl/engine-probe.json`` (else ``~/.cache/...``; ``FLOCKFL_PROBE_CACHE``
names another, ``off`` turns the cache off). A run records which (``engine_reason`` says
``cached``), and a resumed run keeps its state's choice as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from flockfl.cachedir import cache_file
from flockfl.engine import fused
from flockfl.engine.data import Split
from flockfl.engine.functional import conv_layout, memory_format
from flockfl.engine.schedule import LocalSpec, cohort_schedule, restrict
from flockfl.engine.trainers import train_cohort, train_reference


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
    from flockfl.engine.stacking import alone

    with alone():  # a cell of a stack times its own cohort
        return _choose(model, spec, data, task, seed)


def _choose(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int) -> tuple[str, dict]:
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


CACHE_ENV = "FLOCKFL_PROBE_CACHE"


def cache_path() -> Optional[Path]:
    return cache_file(CACHE_ENV, "engine-probe.json")


def probe_key(model: nn.Module, spec: LocalSpec, data: Split, seed: int) -> str:
    """What the two trainers' times depend on (not the data's values, nor the seed's draws)."""
    steps = max(len(b) for b in cohort_schedule(spec, data.sizes, seed, 2**31 - 2))
    extras = sorted(f.name for f in dataclasses.fields(spec)
                    if f.name not in ("clients", "init", "lr", "meta", "stream", "lr_schedule")
                    and getattr(spec, f.name) not in (None, 0, 0.0, False) and not isinstance(getattr(spec, f.name), str))
    facts = {"model": repr(model), "layout": str(memory_format(conv_layout(model), data.x.device)),
             "shapes": {k: list(v.shape) for k, v in spec.init.items()},
             "sample": list(data.x.shape[1:]), "dtype": str(data.x.dtype), "device": str(data.x.device),
             "fused_update": fused.available(),
             "clients": len(spec.clients), "steps": steps, "batch": spec.batch_size, "extras": extras,
             "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.node(),
             "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_choice(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int) -> tuple[str, dict, bool]:
    """:func:`choose_engine`'s verdict, from this machine's cache when it holds one for the same
    key, else measured and kept: (choice, timings, cached)."""
    path = cache_path()
    if path is None:
        return (*choose_engine(model, spec, data, task, seed), False)
    key = probe_key(model, spec, data, seed)
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}  # a damaged cache is measured over
    hit = known.get(key)
    if isinstance(hit, dict) and hit.get("choice") in ("vectorized", "reference"):
        return hit["choice"], dict(hit.get("timings") or {}), True
    choice, timings = choose_engine(model, spec, data, task, seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: {"choice": choice, "timings": timings}}, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written is measured next time
    return choice, timings, False
