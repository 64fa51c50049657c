"""The algorithm interface: five hooks, whose defaults are FedAvg.

An algorithm is a class with pure hooks over (state, inputs):

- ``init_state(ctx)`` → the round-0 :class:`ServerState`;
- ``select(state, ctx, round)`` → the client ids of the cohort;
- ``local_spec(state, ctx, clients, round)`` → a :class:`LocalSpec` (initial params,
  schedule knobs, anything the later hooks need in ``meta``);
- ``cluster(state, ctx, spec, result)`` → the cluster of each trained client;
- ``aggregate(state, ctx, spec, result, assign)`` → the new ``ServerState``;
- ``evaluate(state, ctx)`` → per-client and summary metrics.

A subclass overrides only what differs from FedAvg. Hooks never touch files, Prefect or
MLflow; the flow (``flows/experiment.py``) calls them through thin tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from flockfl.config import ExperimentConfig
from flockfl.data.clients import ClientData
from flockfl.engine.functional import losses_under_models, num_params, segment_mean, stack
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from flockfl.system import SystemProfile, make_profile
from models import init_params


@dataclass
class RunContext:
    """What every hook may read: the config, the model template and the client data."""

    cfg: ExperimentConfig
    model: nn.Module
    data: ClientData
    truth: dict = field(default_factory=dict)  # ground truth known to the generator (e.g. θ*)
    system: Optional[SystemProfile] = None  # simulated client speeds; drawn from cfg.system if not given

    def __post_init__(self) -> None:
        if self.system is None:
            self.system = make_profile(self.cfg.system, self.cfg.seed, self.data.num_clients)

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def num_clients(self) -> int:
        return self.data.num_clients


class Algorithm:
    """FedAvg (McMahan et al., arXiv 1602.05629): E local epochs of SGD, sample-weighted mean."""

    name = "fedavg"
    default_weighting = "samples"
    options: tuple[str, ...] = ()  # allowed algorithm.option values; the first is the default
    # the algorithm.* hyper-parameters this algorithm reads, with their defaults
    hyper: dict[str, Any] = {}

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.weighting = cfg.algorithm.weighting or self.default_weighting
        self.option = cfg.algorithm.option or (self.options[0] if self.options else None)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Raise ValueError (one line) for settings this algorithm cannot honour."""
        a = cfg.algorithm
        if a.option is not None and a.option not in cls.options:
            allowed = ", ".join(cls.options) if cls.options else "none (leave it unset)"
            raise ValueError(f"algorithm.option: {a.option!r} is not an option of {cls.name}; allowed: {allowed}")

    def hp(self, key: str) -> Any:
        """A hyper-parameter: the configured value, else this algorithm's default."""
        value = getattr(self.cfg.algorithm, key)
        return self.hyper[key] if value is None else value

    # ------------------------------------------------------------------ state
    @property
    def num_models(self) -> int:
        return 1

    def init_models(self, ctx: RunContext) -> dict[str, torch.Tensor]:
        return stack([init_params(ctx.model, torch_generator(ctx.seed, client=j, purpose="init")) for j in range(self.num_models)])

    def init_state(self, ctx: RunContext) -> ServerState:
        n = ctx.num_clients
        return ServerState(
            round=0,
            models=self.init_models(ctx),
            assignments=np.full(n, -1 if self.num_models > 1 else 0, np.int64),
            assignment_history=np.zeros((0, n), np.int64),
            meta={"rng": "numpy PCG64(SeedSequence([seed, round+1, client+1, crc32(purpose)]))", "algorithm": self.name},
        )

    # ------------------------------------------------------------------ hooks
    def select(self, state: ServerState, ctx: RunContext, round: int) -> np.ndarray:
        """K clients uniformly without replacement from the (seed, round, 'select') stream."""
        k = min(self.cfg.train.clients_per_round, ctx.num_clients)
        rng = np_rng(ctx.seed, round, purpose="select")
        return np.sort(rng.choice(ctx.num_clients, size=k, replace=False))

    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        t = self.cfg.train
        # every client starts from model 0: a broadcast view, materialised once by the trainer
        init = {k: v[:1].expand(len(clients), *v.shape[1:]) for k, v in state.models.items()}
        return LocalSpec(clients, init, t.lr, t.local_epochs, t.local_steps, t.batch_size, t.full_batch,
                         meta={"model_of_client": np.zeros(len(clients), np.int64)},
                         client_epochs=self.local_work(ctx, clients, round))

    def local_work(self, ctx: RunContext, clients: np.ndarray, round: int) -> np.ndarray | None:
        """Per-client epochs when ``train.local_work=uniform_random`` (E_i ~ U{1..E})."""
        t = self.cfg.train
        if t.local_work == "constant":
            return None
        return np.array([np_rng(ctx.seed, round, int(c), "local_work").integers(1, t.local_epochs + 1) for c in clients])

    def pseudo_gradient(self, state: ServerState, result: TrainResult) -> dict[str, torch.Tensor]:
        """Δ = Σ_i p_i (x − x_i) over the trained clients (positive in the descent direction),
        with p_i from ``algorithm.weighting``."""
        everyone = np.arange(len(result.clients))
        w = self.weights(result, everyone)
        out = {}
        for k, v in state.models.items():
            x = v[0]
            mean = (w.to(x.dtype) @ result.params[k].reshape(len(everyone), -1)).reshape(x.shape)
            out[k] = x - mean
        return out

    def cluster(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult) -> np.ndarray:
        """The cluster of each trained client: the model it started from."""
        pos = {int(c): i for i, c in enumerate(spec.clients)}
        return np.array([spec.meta["model_of_client"][pos[int(c)]] for c in result.clients], np.int64)

    def weights(self, result: TrainResult, members: np.ndarray) -> torch.Tensor:
        w = result.num_samples[members].astype(np.float64) if self.weighting == "samples" else np.ones(len(members))
        return torch.from_numpy(w / w.sum()).to(torch.float32)

    def aggregate(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult,
                  assign: np.ndarray) -> ServerState:
        """Per model j: the weighted mean of the clients that trained it; untouched if none did."""
        models = {k: v.clone() for k, v in state.models.items()}
        for j in range(state.k):
            members = np.flatnonzero(assign == j)
            if len(members) == 0:
                continue
            w = self.weights(result, members)
            everyone = len(members) == len(result.clients)
            for k in models:
                p = result.params[k] if everyone else result.params[k][torch.from_numpy(members)]
                models[k][j] = (w.to(p.dtype) @ p.reshape(len(members), -1)).reshape(p.shape[1:])
        return self._with_assignments(state, models, result.clients, assign)

    def _with_assignments(self, state: ServerState, models: dict, clients: np.ndarray, assign: np.ndarray) -> ServerState:
        assignments = state.assignments.copy()
        assignments[clients] = assign
        return state.replace(models=models, assignments=assignments)

    # ------------------------------------------------------------------ evaluation
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        """The model each client uses at evaluation (the single global model by default)."""
        return np.zeros(ctx.num_clients, np.int64)

    def evaluate(self, state: ServerState, ctx: RunContext) -> dict[str, Any]:
        return evaluate_models(state.models, self.eval_assignment(state, ctx), ctx)

    # ------------------------------------------------------------------ accounting
    def sim_round_time(self, state: ServerState, ctx: RunContext, clients: np.ndarray, steps: np.ndarray) -> float:
        """Simulated seconds of a synchronous round: the slowest client's compute + transfers."""
        down, up = self.comm_bytes(state, clients[:1])  # one client's bytes each way
        return ctx.system.round_time(clients, steps, down / 1e6, up / 1e6)

    def comm_bytes(self, state: ServerState, clients: np.ndarray) -> tuple[int, int]:
        """(down, up) bytes of one round: every selected client receives and returns one model."""
        per_model = num_params(state.models) * state.models[next(iter(state.models))].element_size()
        return len(clients) * per_model, len(clients) * per_model


def client_model_losses(model: nn.Module, models: dict[str, torch.Tensor], split, clients: np.ndarray, task: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean loss and accuracy of every listed client under every model, in one vectorised
    pass: returns ([k, C] loss, [k, C] accuracy, [C] sample counts)."""
    offsets = split.offsets
    idx = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in clients]) if len(clients) else np.zeros(0, np.int64)
    seg = np.repeat(np.arange(len(clients)), np.diff(offsets)[clients])
    idx_t = torch.from_numpy(idx).to(split.x.device)
    losses, hits = losses_under_models(model, models, split.x[idx_t], split.y[idx_t], task)
    seg_t = torch.from_numpy(seg).to(losses.device)
    mean_loss, counts = segment_mean(losses, seg_t, len(clients))
    mean_acc, _ = segment_mean(hits, seg_t, len(clients))
    return mean_loss.cpu(), mean_acc.cpu(), counts.cpu()


def evaluate_models(models: dict[str, torch.Tensor], assign: np.ndarray, ctx: RunContext) -> dict[str, Any]:
    """Per-client test metrics with each client's own model, and their summaries."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    clients = np.arange(ctx.num_clients)
    loss, acc, n_test = client_model_losses(ctx.model, models, ctx.data.test, clients, ctx.data.task)
    pick = torch.from_numpy(assign)
    c_loss = loss[pick, torch.arange(len(clients))].numpy().astype(np.float64)
    c_acc = acc[pick, torch.arange(len(clients))].numpy().astype(np.float64)
    n = n_test.numpy()
    has = n > 0
    w = n / max(n.sum(), 1)
    out: dict[str, Any] = {"loss": float((c_loss * w).sum())}
    if ctx.data.task == "classification":
        out["accuracy"] = float((c_acc * w).sum())
        out["accuracy_min"] = float(c_acc[has].min()) if has.any() else float("nan")
        out["accuracy_p10"] = float(np.percentile(c_acc[has], 10)) if has.any() else float("nan")
    k = next(iter(models.values())).shape[0]
    for j in range(k):
        m = (assign == j) & has
        out[f"cluster/{j}/clients"] = int((assign == j).sum())
        if m.any():
            key = "accuracy" if ctx.data.task == "classification" else "loss"
            vals = c_acc if key == "accuracy" else c_loss
            out[f"cluster/{j}/{key}"] = float((vals[m] * n[m]).sum() / n[m].sum())
    out["num_clusters"] = int(len(np.unique(assign)))
    group = ctx.data.group
    if (group >= 0).all() and len(np.unique(group)) > 1:
        out["ari"] = float(adjusted_rand_score(group, assign))
        out["nmi"] = float(normalized_mutual_info_score(group, assign))
    if "theta" in ctx.truth:
        out["min_dist"] = min_dist(models, ctx.truth["theta"])
    out["_client_accuracy"] = c_acc if ctx.data.task == "classification" else None
    out["_client_loss"] = c_loss
    out["_assignment"] = assign
    return out


def min_dist(models: dict[str, torch.Tensor], theta: np.ndarray) -> float:
    """IFCA's metric: (1/k) Σ_j min_j' ‖θ_j − θ*_j'‖ for linear models."""
    w = next(iter(models.values())).reshape(next(iter(models.values())).shape[0], -1).double()
    t = torch.as_tensor(theta, dtype=torch.float64)
    return float(torch.cdist(w, t).min(1).values.mean())

