"""``train.engine=auto``'s probe: :func:`choose_engine` times both trainers of
:mod:`flockfl.engine.trainers` on a cohort and returns the faster one with the timings (the
round driver asks it once, on the first cohort, and keeps the choice).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from torch import nn

from flockfl.engine.data import Split
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
