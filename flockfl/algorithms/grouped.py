"""What FlexCFL (``flexcfl.py``) and FeSEM (``fesem.py``) share, after the FlexCFL code: m group
models with every client in one group or cold (−1), round-robin selection, the label-count shift
detector and its hyper-parameters, current-membership evaluation, and flat float64 rows of
parameters for the NumPy group maths (:mod:`flockfl.clustering.groups`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flockfl.aggregation import flatten, unflatten
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import Hyper, choice, is_auto, real
from flockfl.clustering.groups import label_counts, shift_detected
from flockfl.context import RunContext
from flockfl.engine.functional import index_params
from flockfl.evaluation import evaluate_models
from flockfl.rng import torch_generator
from flockfl.state import ServerState, log_round
from models import init_params


def rows64(params: dict[str, torch.Tensor]) -> np.ndarray:
    """Stacked parameters [n, ...] → float64 rows [n, d] (parameter order = dict order)."""
    return flatten(params).detach().double().cpu().numpy()


def from_row(row: np.ndarray, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One float64 row [d] → parameters shaped like ``like`` (unstacked), in its dtype and device."""
    flat = torch.from_numpy(np.ascontiguousarray(row))
    return {k: v.to(like[k].dtype).to(like[k].device) for k, v in unflatten(flat, like, lead=0).items()}


def round_robin_or_random(alg: Algorithm, state: ServerState, ctx: RunContext, round: int, on: bool) -> np.ndarray:
    """The code's selection: the federating clients in id order, K at a time (wrapping), while
    round < N/K; then the base class's uniform draw from (seed, round, "select")."""
    pool = ctx.seen
    k = min(alg.cfg.train.clients_per_round, len(pool))
    if on and round < len(pool) / k:
        head = round * k
        return np.sort(pool[(head + np.arange(k)) % len(pool)])
    return Algorithm.select(alg, state, ctx, round)


def with_round_log(state: ServerState, **counts: float) -> ServerState:
    """A state whose meta (and round log) is a fresh copy with the counts added."""
    meta = dict(state.meta)
    meta["round_log"] = dict(meta.get("round_log") or {})
    state = state.replace(meta=meta)
    log_round(state, **counts)
    return state


def shift_hypers(migration_default: bool) -> tuple[Hyper, ...]:
    return (
        Hyper("migration", migration_default, "before each round's training, re-assign every warm client whose label "
              "distribution shifted (Eq. 9): FlexCFL redoes its cold start, FeSEM-MIG its ℓ2 assignment (false: "
              "static groups; flexcfl with false is FedGroup)", "", "bool"),
        choice("shift_detector", "code", ("code", "label_aware"),
               "Eq. 9's W1: the code's (count vectors as 1-D samples, > τ_i = tau_ratio·n_i/C) or over class "
               "indices between label distributions (> tau_ratio)"),
        real("tau_ratio", 0.2, "shift threshold: the share of a client's data that must change (τ_i = tau_ratio·n_i/C)",
             "τ", gt=0),
        Hyper("round_robin", True, "select clients round-robin in id order for the first ⌈N/K⌉ rounds (the code), "
              "then at random", "", "bool"),
    )


class GroupedClients(Algorithm):
    """m group models; a client is in one group or cold (-1). Shared by FlexCFL and FeSEM:
    round-robin selection, the shift detector, current-membership evaluation."""

    family = "clustered"
    one_cluster_is_fedavg = True

    @property
    def num_models(self) -> int:
        """m; with k=auto (FlexCFL) one until the group cold start chooses m."""
        return 1 if is_auto(self.cfg.algorithm.k) else self.cfg.algorithm.k

    @classmethod
    def check_config(cls, cfg) -> None:
        n = cfg.partition.num_clients
        if n is not None and not is_auto(cfg.algorithm.k) and cfg.algorithm.k > n:
            raise ValueError(f"algorithm.k: {cfg.algorithm.k} groups exceed the {n} clients (partition.num_clients); lower it")

    def init_state(self, ctx: RunContext) -> ServerState:
        state = super().init_state(ctx)
        algo = dict(state.algo)
        if ctx.data.task == "classification":  # each client's reference label counts: those it was built with
            algo["label_counts"] = torch.from_numpy(label_counts(ctx.base_data.train, ctx.data.num_classes))
        return state.replace(assignments=np.full(ctx.num_clients, -1, np.int64), algo=algo)

    def w0(self, ctx: RunContext) -> dict[str, torch.Tensor]:
        """The global initial model: FedAvg's (seed, client 0, "init") draw."""
        return init_params(ctx.model, torch_generator(ctx.seed, client=0, purpose="init"))

    def select(self, state, ctx, round):
        return round_robin_or_random(self, state, ctx, round, self.cfg.algorithm.round_robin)

    def warm(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return ctx.seen[state.assignments[ctx.seen] >= 0]

    def shift_pool(self, state, ctx):
        """Swaps touch only warm clients (the code)."""
        return self.warm(state, ctx)

    def model_of(self, state, ctx, clients):
        return state.assignments[clients]

    def eval_assignment(self, state, ctx):
        return state.assignments

    def shifted_clients(self, state: ServerState, ctx: RunContext) -> tuple[np.ndarray, np.ndarray]:
        """(warm clients whose shift detector fires, their current label counts)."""
        a = self.cfg.algorithm
        none = np.zeros(0, np.int64), np.zeros((0, max(ctx.data.num_classes, 1)), np.int64)
        if not a.migration or ctx.cfg.shift.kind == "none" or "label_counts" not in state.algo:
            return none
        warm = self.warm(state, ctx)
        if len(warm) == 0:
            return none
        curr = label_counts(ctx.data.train, ctx.data.num_classes)[warm]
        prev = state.algo["label_counts"].numpy()[warm]
        n0 = ctx.base_data.train.sizes[warm]
        fire = shift_detected(curr, prev, n0, a.tau_ratio, a.shift_detector)
        return warm[fire], curr[fire]

    def store_counts(self, state: ServerState, clients: np.ndarray, counts: np.ndarray) -> dict:
        algo = dict(state.algo)
        if len(clients):
            lc = algo["label_counts"].clone()
            lc[torch.from_numpy(clients)] = torch.from_numpy(counts).to(lc.dtype)
            algo["label_counts"] = lc
        return algo

    def fallback_model(self, state: ServerState, ctx: RunContext) -> dict[str, torch.Tensor]:
        """The model a still-cold client uses where one is needed (fine-tuning)."""
        return {k: v.mean(0) for k, v in state.models.items()}

    def evaluate(self, state: ServerState, ctx: RunContext) -> dict[str, Any]:
        """Each warm federating client with its group's model (current membership)."""
        warm = self.warm(state, ctx)
        out = evaluate_models(state.models, state.assignments, ctx, warm if len(warm) else ctx.seen)
        out["clients_warm"] = int(len(warm))
        out["coverage"] = float(len(warm) / max(len(ctx.seen), 1))
        return out

    def own_models(self, state, ctx, clients, assign):
        """A still-cold client (−1) fine-tunes from ``fallback_model``."""
        assign = np.asarray(assign, np.int64)
        if (assign >= 0).all():
            return super().own_models(state, ctx, clients, assign)
        extra = self.fallback_model(state, ctx)
        models = {k: torch.cat([v, extra[k].unsqueeze(0)]) for k, v in state.models.items()}
        return index_params(models, torch.from_numpy(np.where(assign >= 0, assign, state.k)))
