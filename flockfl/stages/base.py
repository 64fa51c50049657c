"""The protocol of a stage that composes with every algorithm (curriculum, pruning, shift).

A stage is built from the config once per run (``active(cfg)`` says whether it takes part)
and the round driver (``flockfl.rounds``) calls each hook of every active stage, in the
order of ``flockfl.stages.STAGES``, at one fixed point of the round. Every hook's default
does nothing, so a stage overrides only the points it acts at. Counts a hook wants in the
round's history row go through ``flockfl.state.log_round``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from flockfl.context import RunContext
    from flockfl.engine.schedule import LocalSpec
    from flockfl.engine.trainers import TrainResult
    from flockfl.state import ServerState


class Stage:
    name = ""
    paper = ""

    @classmethod
    def active(cls, cfg) -> bool:
        """Whether this run uses the stage (its config section is not off)."""
        return False

    def sync(self, ctx: "RunContext", state: "ServerState") -> None:
        """Before selection and before evaluation: bring ``ctx`` in line with ``state``."""

    def select(self, ctx: "RunContext", state: "ServerState", algorithm, clients: np.ndarray, round: int) -> np.ndarray:
        """After the algorithm's ``select``: the cohort (a client curriculum replaces it)."""
        return clients

    def after_select(self, ctx: "RunContext", algorithm, state: "ServerState", round: int) -> "ServerState":
        """After selection, before the algorithm's ``before_training``: change the data."""
        return state

    def on_spec(self, ctx: "RunContext", state: "ServerState", spec: "LocalSpec", round: int) -> "LocalSpec":
        """After the algorithm's ``local_spec``: how each client trains (masks, batch order)."""
        return spec

    def after_train(self, ctx: "RunContext", spec: "LocalSpec", result: "TrainResult") -> "TrainResult":
        """Part of each shard's local work, after the trainer (on the worker that trained it)."""
        return result

    def before_aggregate(self, algorithm, state: "ServerState", result: "TrainResult", assign: np.ndarray) -> "TrainResult":
        """What the clients send for the algorithm's ``aggregate``."""
        return result

    def after_aggregate(self, state: "ServerState", result: "TrainResult") -> None:
        """After the algorithm's ``aggregate``, on the new state: keep per-client rows, log counts."""

    def on_evaluate(self, prep, state: "ServerState", metrics: dict[str, Any], round: int, tune: bool) -> dict[str, Any]:
        """Metrics to add to the round's evaluation."""
        return {}

    def upload(self, result: "TrainResult") -> tuple[int, float]:
        """(bytes not uploaded, the paper's own communication figure) of a trained cohort."""
        return 0, 0.0

    def row(self, bytes_thesis: float, last: dict[str, Any]) -> dict[str, Any]:
        """Columns this stage adds to every history row (``last`` is the previous row)."""
        return {}
