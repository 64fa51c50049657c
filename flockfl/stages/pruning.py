"""The ``pruning`` stage: Sub-FedAvg (thesis Chapter 4; :mod:`flockfl.stages.subfedavg`, whose
docstring gives the method) bound to the round's hooks, for any mini-batch SGD algorithm. Each
hook says when in the round the method acts; the method's maths is in ``subfedavg.py``.
"""

from __future__ import annotations

import numpy as np

from flockfl.errors import ConfigError
from flockfl.engine.schedule import LocalSpec
from flockfl.stages.base import Stage, log_mean
from flockfl.stages.subfedavg import SubFedAvg
from flockfl.state import log_round


class Pruning(SubFedAvg, Stage):
    """The ``pruning`` section, bound to one run's model."""

    name = "pruning"
    paper = ("Vahidian et al., Personalized Federated Learning by Structured and Unstructured Pruning under Data "
             "Heterogeneity (Sub-FedAvg, ICDCS-W 2021; thesis Chapter 4)")

    @classmethod
    def active(cls, cfg) -> bool:
        return cfg.pruning.method != "none"

    # ------------------------------------------------------------------ stage hooks
    def on_spec(self, ctx, state, spec: LocalSpec, round: int) -> LocalSpec:
        """Each client starts from its subnetwork and trains masked. A client trained by its own
        solver (FedSplit's exact prox, Per-FedAvg's MAML step, pFedMe's inner solve) never applies
        the masks, so pruning it would silently average unmasked updates: refused in one line."""
        if spec.solver is not None:
            raise ConfigError(f"pruning.method: Sub-FedAvg trains each client masked, but algorithm.name="
                              f"{ctx.cfg.algorithm.name} trains each client with its own local solver, which cannot "
                              "apply masks; use pruning.method=none or a mini-batch SGD algorithm")
        return self.prepare_spec(state, spec, ctx.data.train.sizes)

    def after_train(self, ctx, spec: LocalSpec, result):
        """The client's own prune decision (Sub-FedAvg's ClientUpdate) is part of its local work."""
        return self.client_update(ctx, spec, result)

    def before_aggregate(self, algorithm, state, result, assign: np.ndarray):
        return self.fill(algorithm, state, result, assign)

    def after_aggregate(self, state, result) -> None:
        counts, means = self.record(state, result)
        log_round(state, **counts)
        log_mean(state, len(result.clients), **means)

    def on_evaluate(self, prep, state, metrics: dict, round: int, tune: bool) -> dict:
        """Every client with its own subnetwork, as downloaded and after local training."""
        return self.evaluate(prep, state, metrics, round, tune)

    def row(self, bytes_thesis: float, last: dict) -> dict:
        return {"bytes_thesis": bytes_thesis, "comm_bytes_thesis": last.get("comm_bytes_thesis", 0.0) + bytes_thesis}
