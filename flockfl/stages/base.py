"""The protocol of a stage that composes with every algorithm (curriculum, pruning, shift).

A stage is built from the config once per run (``active(cfg)`` says whether it takes part)
and the round driver (``flockfl.rounds``) calls each hook of every active stage, in the
order of ``flockfl.stages.STAGES``, at one fixed point of the round. Every hook's default
does nothing, so a stage overrides only the points it acts at. Counts a hook wants in the
round's history row go through ``flockfl.state.log_round`` (summed over a round's cycles), means
through :func:`log_mean` (a mean over the round's cycles).

Round-level and cycle-level hooks. A multi-cycle algorithm (FedCluster's M cycles,
``Algorithm.cycles_per_round``) runs select → train → cluster → aggregate once per cycle, but a
stage acts on the *round* (DESIGN: "once per round, not per cycle"): ``select`` and
``after_select`` run once per round, in its first cycle (a run resumed mid-round, at cycle c > 0,
finds their effect in the checkpointed state and does not run them again). A stage whose
``select`` replaces the algorithm's cohort (``replaces_cohort``: a client curriculum) chooses the
round's cohort there; the driver keeps it in ``state.meta['round_cohort']`` for the round and
each cycle trains its share of it (``flockfl.rounds.cycle_share``). The other hooks follow the
clients a cycle trains (``sync``, ``on_spec``, ``after_train``, ``before_aggregate``,
``after_aggregate``, ``upload``) or the round's end (``on_evaluate``, ``row``).
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

    def input_files(self) -> dict[str, str]:
        """The files (or model URIs) this stage's config names, ``section.key`` → source: the run's
        preparation reads each into ``ctx.inputs[key]`` (:mod:`flockfl.inputs`), as an algorithm's."""
        return {}

    def sync(self, ctx: "RunContext", state: "ServerState") -> None:
        """Before selection and before evaluation: bring ``ctx`` in line with ``state``."""

    #: True when ``select`` replaces the algorithm's draw by a cohort of its own (a client curriculum)
    replaces_cohort = False

    def select(self, ctx: "RunContext", state: "ServerState", algorithm, clients: np.ndarray, round: int) -> np.ndarray:
        """Once per round (its first cycle), after the algorithm's ``select``: the round's cohort
        (a client curriculum replaces it; set ``replaces_cohort`` then)."""
        return clients

    def after_select(self, ctx: "RunContext", algorithm, state: "ServerState", round: int) -> "ServerState":
        """Once per round (its first cycle), after selection, before the algorithm's
        ``before_training``: change the data (the round's distribution shift)."""
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


def log_mean(state: "ServerState", weight: float, **means: float) -> None:
    """Add means to this round's history row: over a round's cycles, the ``weight``-weighted
    mean of what each cycle logged (``log_round`` would sum them). The running weight is kept
    in the round's log under ``_n/<name>``, which the row leaves out."""
    if weight <= 0:
        return
    log = dict(state.meta.get("round_log") or {})
    for k, v in means.items():
        n = log.get(f"_n/{k}", 0)
        log[k] = v if n == 0 else (log[k] * n + v * weight) / (n + weight)
        log[f"_n/{k}"] = n + weight
    state.meta = {**state.meta, "round_log": log}  # new dicts: earlier states sharing meta are untouched
