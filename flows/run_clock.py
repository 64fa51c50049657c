"""Where a run's time goes, as ``flockfl run --json`` reports it: the wall time of the flow's
phases (``phases_s``: partition, restore, tracker, cores_wait, drive, plots, finalise, …;
:func:`timed`) and, round by round, each round's wall time and what it cost beyond the task
bodies (:class:`RoundClock`), from which the summary's ``rounds_wall_s``, ``round_s_median``
and ``orchestration_ms_median`` come."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

import tasks


@contextmanager
def timed(phases: dict, name: str):
    """Adds the block's wall time to ``phases[name]`` (``flockfl run --json``'s ``phases_s``)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t


class RoundClock:
    """The rounds' clock: ``phases`` (``phases_s``), each round's wall time (``periods``: since
    the end of the previous round, of the pre-federation step or the start of the rounds) and
    its ``overhead`` (that time minus the time spent inside task bodies, ``tasks.BODY_SECONDS``)."""

    def __init__(self, phases: dict):
        self.phases = phases
        self.periods: list[float] = []
        self.overhead: list[float] = []
        self.t0, self.body0 = time.perf_counter(), tasks.BODY_SECONDS[0]
        self.drive0 = self.t0

    def start(self) -> None:
        """The rounds start (``rounds.drive``)."""
        self.drive0 = self.t0 = time.perf_counter()

    def pre_federation_done(self) -> None:
        self.phases["pre_federation"] = time.perf_counter() - self.drive0  # the algorithm's one-shot step
        self.t0, self.body0 = time.perf_counter(), tasks.BODY_SECONDS[0]

    def round_done(self) -> None:
        now = time.perf_counter()
        self.periods.append(now - self.t0)
        # what the round cost beyond the task bodies: Prefect's task machinery plus the
        # flow's own bookkeeping (engine lookup, history row, progress bar)
        self.overhead.append(self.periods[-1] - (tasks.BODY_SECONDS[0] - self.body0))
        self.t0, self.body0 = now, tasks.BODY_SECONDS[0]

    def rounds_wall_s(self) -> float:
        """The rounds this process ran (checkpoints and logging included) and the algorithm's one-shot
        pre-federation step: the run's compute; what the process spends beyond it is fixed cost."""
        return float(sum(self.periods)) + self.phases.get("pre_federation", 0.0)

    def round_s_median(self) -> float:
        """The median round, leaving out the first (it warms up) when there are others."""
        timed = self.periods[1:] or self.periods
        return float(np.median(timed)) if timed else float("nan")

    def orchestration_ms_median(self) -> float:
        overhead = self.overhead
        return float(np.median(overhead[1:] or overhead)) * 1000 if overhead else float("nan")
