"""Deterministic crash points for resume drills.

``FLOCKFL_CRASH_AT=<round>:<point>`` makes the process SIGKILL itself when round
``<round>`` (0-based) reaches ``<point>``: ``pre_federation`` (round 0 only), ``select``, ``train``, ``aggregate``,
``evaluate``, ``cycle`` (after a mid-round checkpoint of a multi-cycle round), ``checkpoint_tmp`` (temp file written, not yet renamed) or ``checkpoint``.
Unset, it costs one dict lookup per point. A point is one state of the run: checkpoints are written
behind the rounds (:class:`flockfl.state.CheckpointWriter`), and the one in flight is on disk before
the kill, but at ``checkpoint_tmp`` and ``checkpoint``, which are inside that write.
"""

from __future__ import annotations

import os
import signal

BEFORE_KILL: list = []  # called before a drill's kill (flockfl.engine.runtime: the background work lands)

POINTS = ("pre_federation", "select", "train", "aggregate", "evaluate", "cycle", "checkpoint_tmp", "checkpoint")


def maybe_crash(point: str, round: int) -> None:
    spec = os.environ.get("FLOCKFL_CRASH_AT")
    if spec and spec == f"{round}:{point}":
        # a point is one state of the run: the checkpoint a background thread is writing (the round
        # before) is on disk first, unless the point is in that write itself (``checkpoint_tmp``)
        for settle in BEFORE_KILL:
            settle()
        os.kill(os.getpid(), signal.SIGKILL)
