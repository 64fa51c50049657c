"""Stages that compose with every algorithm. Adding one is a module here implementing
:class:`~flockfl.stages.base.Stage` and one line in ``STAGES`` (whose order is the order
the driver calls their hooks in)."""

from __future__ import annotations

from flockfl.stages.base import Stage
from flockfl.stages.curriculum import Curriculum
from flockfl.stages.pruning import Pruning
from flockfl.stages.shift import Shift

STAGES: tuple[type[Stage], ...] = (Shift, Pruning, Curriculum)


def build_stages(cfg, model) -> dict[str, Stage]:
    """The stages this run uses, by name, in hook order."""
    return {cls.name: cls(cfg, model) for cls in STAGES if cls.active(cfg)}


__all__ = ["STAGES", "Curriculum", "Pruning", "Shift", "Stage", "build_stages"]
