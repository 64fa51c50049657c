"""Pacing functions g(t) (thesis Table 2.1, spec §1.2) and paced batch draws.

Kept free of engine imports: the batch schedule (``flockfl.engine.schedule``) uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Pacing:
    """A pacing function g(t) (thesis Table 2.1): how many of a client's N ranked samples
    local step t (0-based) may draw from, over a budget of T steps.

    ``b`` is the share exposed at t = 0 and ``a`` the share of the budget after which all N
    are used. The printed root, linear and quadratic rows grow by (N − b); with
    ``literal=False`` (default) every family grows by N(1 − b), as the exponential row does,
    so that g(aT) = N as the text says a means (spec §1.2). The result is ⌈·⌉ clipped to
    [1, N]; a = 0 or b = 1 is ordinary training (g ≡ N).

    ``offset`` and ``total`` put the clock on the whole run (``pacing_scope=global``):
    step t of round r is t + offset of a budget ``total``."""

    family: str = "linear"
    a: float = 0.8
    b: float = 0.2
    literal: bool = False
    offset: int = 0
    total: Optional[int] = None

    def size(self, t: int, n: int, steps: int) -> int:
        big_t = self.total if self.total is not None else steps
        return pacing_size(self.family, t + self.offset, n, big_t, self.a, self.b, self.literal)


def pacing_size(family: str, t: float, n: int, big_t: int, a: float, b: float, literal: bool = False) -> int:
    """g(t) of Table 2.1, ⌈·⌉ and clipped to [1, N] (see :class:`Pacing`)."""
    if n <= 0:
        return 0
    at = a * big_t
    if at <= 0 or b >= 1:
        return n
    grow = (n - b) if literal else n * (1 - b)
    if family == "exp":
        g = n * b + n * (1 - b) / (math.exp(10) - 1) * (math.exp(10 * t / at) - 1) if t < at else float(n)
    elif family == "step":
        g = n * b + n * math.floor(t / at)
    elif family == "root":
        g = n * b + grow / math.sqrt(at) * math.sqrt(t)
    elif family == "linear":
        g = n * b + grow / at * t
    elif family == "quad":
        g = n * b + grow / at**2 * t**2
    else:
        raise ValueError(f"unknown pacing family {family!r}; choose one of exp, step, root, linear, quad")
    return int(min(n, max(1, math.ceil(g - 1e-9))))


def paced_batches(order: np.ndarray, pacing: Pacing, steps: int, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Curriculum batches (Algorithm 1): step t draws ``batch`` distinct samples uniformly
    from the first g(t) of ``order`` (fewer if g(t) is smaller)."""
    n = len(order)
    out = []
    for t in range(steps):
        g = pacing.size(t, n, steps)
        take = min(batch, g)
        out.append(order[np.sort(rng.choice(g, size=take, replace=False))] if take < g else order[:g].copy())
    return out
