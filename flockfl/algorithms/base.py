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

from flockfl.clientstate import chunks
from flockfl.config import ExperimentConfig
from flockfl.engine.data import ClientData
from flockfl.engine.functional import index_params, losses_under_models, num_params, segment_mean, stack
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.algorithms.hyper import Hyper, declared, weighting
from flockfl.rng import np_rng, torch_generator
from flockfl.curriculum.stage import Curriculum
from flockfl.pruning.stage import Pruning
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
    # clients that federate, and the newcomers (partition.unseen_fraction) that join afterwards
    seen: np.ndarray = field(init=False)
    unseen: np.ndarray = field(init=False)
    # the data as partitioned; ``data`` is the current view, which a distribution shift
    # (``shift.*``, flockfl/data/shift.py) changes from round to round
    base_data: ClientData = field(init=False)
    data_version: int = field(init=False, default=0)
    # the stages that compose with every algorithm (flockfl/curriculum, flockfl/pruning): built from cfg
    curriculum: Curriculum = field(init=False)
    pruning: Pruning = field(init=False)

    def __post_init__(self) -> None:
        self.base_data = self.data
        self.curriculum = Curriculum(self.cfg)
        self.pruning = Pruning(self.cfg, self.model)
        if self.system is None:
            self.system = make_profile(self.cfg.system, self.cfg.seed, self.data.num_clients)
        self.unseen = unseen_clients(self.data.num_clients, self.cfg.partition.unseen_fraction, self.cfg.seed)
        self.seen = np.setdiff1d(np.arange(self.data.num_clients), self.unseen)

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def num_clients(self) -> int:
        return self.data.num_clients


def unseen_clients(n: int, fraction: float, seed: int) -> np.ndarray:
    """round(fraction·n) clients, drawn from the (seed, "unseen") stream, that never train."""
    count = int(round(fraction * n))
    if count == 0:
        return np.zeros(0, np.int64)
    return np.sort(np_rng(seed, purpose="unseen").choice(n, size=count, replace=False)).astype(np.int64)


class Algorithm:
    """FedAvg (McMahan et al., arXiv 1602.05629): E local epochs of SGD, sample-weighted mean."""

    name = "fedavg"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, arXiv 1602.05629"
    # the algorithm.* keys this class reads (a subclass adds or redeclares; see hyper.py)
    hyperparameters: tuple[Hyper, ...] = (weighting("samples"),)
    # top-level keys of ``state.algo`` whose tensors live on the run's device (with the models):
    # a resumed run moves them back there (see ``flockfl.rounds.on_device``); dicts keyed by
    # parameter names (server moments, control variates) need no entry
    device_state_keys: tuple[str, ...] = ()

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.weighting = self.hp("weighting")
        self.option = self.hp("option") if "option" in declared(type(self)) else None

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """Raise ValueError (one line) for settings that are valid alone but not together.

        Each hyper-parameter's own range is declared in ``hyperparameters`` and checked
        before this is called."""

    def hp(self, key: str) -> Any:
        """A hyper-parameter's value (the configured one, or its declared default)."""
        return getattr(self.cfg.algorithm, key)

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
    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """A one-shot step before round 0 (PACFL's signatures, FLIS-HC's clustering, ...).

        Runs once, as its own task; its result lives in the returned state (so a resumed run
        never redoes it). Put its communication in ``state.meta['pre_federation_bytes']`` as
        ``{"up": .., "down": ..}``. The default does nothing."""
        return state

    @classmethod
    def has_pre_federation(cls) -> bool:
        return cls.pre_federation is not Algorithm.pre_federation

    def select(self, state: ServerState, ctx: RunContext, round: int) -> np.ndarray:
        """K clients uniformly without replacement from the (seed, round, 'select') stream
        (newcomers, ``ctx.unseen``, never take part)."""
        k = min(self.cfg.train.clients_per_round, len(ctx.seen))
        rng = np_rng(ctx.seed, round, purpose="select")
        if len(ctx.unseen) == 0:  # the draw every run made before newcomers existed
            return np.sort(rng.choice(ctx.num_clients, size=k, replace=False))
        return np.sort(ctx.seen[rng.choice(len(ctx.seen), size=k, replace=False)])

    def cycles_per_round(self, state: ServerState, ctx: RunContext) -> int:
        """Sub-rounds (select → train → cluster → aggregate) in one round (FedCluster's M
        cycles); evaluation follows the last. The driver keeps the running cycle in
        ``state.meta['cycle']`` and checkpoints after each, so a resume can start mid-round."""
        return 1

    def shift_pool(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        """The clients a distribution shift may touch (every federating client; FlexCFL: the
        clients already in a group)."""
        return ctx.seen

    def before_training(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> ServerState:
        """After selection and the round's shift, before ``local_spec``: scheduling that reacts
        to the data (FlexCFL's migration and cold start). Counts for the round's history row
        (e.g. ``clients_migrated``) go in ``state.meta['round_log']``. The default does nothing."""
        return state

    def model_of(self, state: ServerState, ctx: RunContext, clients: np.ndarray) -> np.ndarray:
        """The model each listed client trains this round (model 0 by default; a clustered
        method's cluster of the client)."""
        return np.zeros(len(clients), np.int64)

    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        t = self.cfg.train
        which = self.model_of(state, ctx, clients)
        if state.k == 1:  # every client starts from model 0: a broadcast view, materialised once by the trainer
            init = {k: v[:1].expand(len(clients), *v.shape[1:]) for k, v in state.models.items()}
        else:
            init = index_params(state.models, torch.from_numpy(which))
        return LocalSpec(clients, init, t.lr, t.local_epochs, t.local_steps, t.batch_size, t.full_batch,
                         meta={"model_of_client": which}, client_epochs=self.local_work(ctx, clients, round))

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
        """p_i of the listed members (float32, summing to 1), on the device of the trained parameters."""
        w = result.num_samples[members].astype(np.float64) if self.weighting == "samples" else np.ones(len(members))
        return torch.from_numpy(w / w.sum()).to(torch.float32).to(next(iter(result.params.values())).device)

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
        """Per-client metrics of the clients that federate, each with its own model."""
        return evaluate_models(state.models, self.eval_assignment(state, ctx), ctx, ctx.seen)

    def admit_newcomers(self, state: ServerState, ctx: RunContext, newcomers: np.ndarray
                        ) -> tuple[ServerState, np.ndarray, str]:
        """After federation, clients that never trained join: (state, the model index of each
        newcomer, the rule in words). FedAvg gives them the global model."""
        return state, self.eval_assignment(state, ctx)[newcomers], "the global model"

    def finetune(self, state: ServerState, ctx: RunContext, clients: np.ndarray, assign: np.ndarray, round: int,
                 engine: str, stream: str) -> TrainResult:
        """``train.finetune_epochs`` epochs of plain local SGD for each listed client, from
        the model it is assigned (the thesis's "after its last local training" convention)."""
        from flockfl.engine import TRAINERS

        t = self.cfg.train
        epochs = t.local_epochs if t.finetune_epochs is None else t.finetune_epochs
        assign = np.asarray(assign, np.int64)
        if (assign < 0).any():  # index -1 would silently pick the last model
            raise ValueError(f"{self.name}.finetune: clients {np.asarray(clients)[assign < 0].tolist()} have no model; "
                             "an algorithm with unassigned clients must override finetune")
        init = index_params(state.models, torch.from_numpy(assign))
        spec = LocalSpec(np.asarray(clients, np.int64), init, t.lr, epochs, None, t.batch_size, t.full_batch, stream=stream,
                         momentum=t.momentum)
        return TRAINERS[engine](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round)

    # ------------------------------------------------------------------ accounting
    def sim_round_time(self, state: ServerState, ctx: RunContext, clients: np.ndarray, steps: np.ndarray) -> float:
        """Simulated seconds of a synchronous round: the slowest client's compute + transfers."""
        down, up = self.comm_bytes(state, clients[:1])  # one client's bytes each way
        return ctx.system.round_time(clients, steps, down / 1e6, up / 1e6)

    def model_bytes(self, state: ServerState) -> int:
        """Bytes of one model."""
        return num_params(state.models) * state.models[next(iter(state.models))].element_size()

    def comm_bytes(self, state: ServerState, clients: np.ndarray) -> tuple[int, int]:
        """(down, up) bytes of one round: every selected client receives and returns one model."""
        per_model = self.model_bytes(state)
        return len(clients) * per_model, len(clients) * per_model


def run_engine(cfg: ExperimentConfig, state: ServerState) -> str:
    """The trainer this run uses: the one it chose (``state.meta['engine']``), or the configured
    one before any round has chosen (auto → vectorized)."""
    return state.meta.get("engine") or ("vectorized" if cfg.train.engine == "auto" else cfg.train.engine)


def train_from(ctx: RunContext, state: ServerState, start: dict[str, torch.Tensor], clients: np.ndarray, *,
               epochs: int, steps: Optional[int] = None, round: int = -1, stream: str) -> TrainResult:
    """Plain local SGD (``train.lr``, ``train.batch_size``) of every listed client from one
    model ``start``, outside a round's training (pre-training, local ERMs, newcomers): ``steps``
    steps, or ``epochs`` epochs when None; sharded like a round (``train.shard_size``); batch
    orders from the (seed, ``round``, client, ``stream``) streams."""
    from flockfl.engine import TRAINERS
    from flockfl.engine.schedule import restrict

    t = ctx.cfg.train
    clients = np.asarray(clients, np.int64)
    init = {k: v.unsqueeze(0).expand(len(clients), *v.shape) for k, v in start.items()}
    spec = LocalSpec(clients, init, t.lr, epochs, steps, t.batch_size, t.full_batch, stream=stream, momentum=t.momentum)
    trainer = TRAINERS[run_engine(ctx.cfg, state)]
    return TrainResult.concat([trainer(ctx.model, restrict(spec, slice(a, min(len(clients), a + t.shard_size))),
                                       ctx.data.train, ctx.data.task, ctx.seed, round)
                               for a in range(0, len(clients), t.shard_size)])


def log_round(state: ServerState, **counts: float) -> None:
    """Add counts to this round's history row (summed over a round's cycles), e.g.
    ``log_round(state, clients_migrated=3, bytes_p2p=...)``."""
    log = dict(state.meta.get("round_log") or {})
    for k, v in counts.items():
        log[k] = log.get(k, 0) + v
    state.meta = {**state.meta, "round_log": log}  # new dicts: earlier states sharing meta are untouched


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


EVAL_CHUNK = 4096  # clients per evaluation pass of one model


def summarise_clients(c_loss: np.ndarray, c_acc: np.ndarray, n: np.ndarray, task: str, suffix: str = "") -> dict[str, float]:
    """Sample-weighted mean loss (and accuracy, its minimum and 10th percentile) over clients."""
    has = n > 0
    w = n / max(n.sum(), 1)
    out = {f"loss{suffix}": float((c_loss * w).sum())}
    if task == "classification":
        out[f"accuracy{suffix}"] = float((c_acc * w).sum())
        out[f"accuracy{suffix}_min"] = float(c_acc[has].min()) if has.any() else float("nan")
        out[f"accuracy{suffix}_p10"] = float(np.percentile(c_acc[has], 10)) if has.any() else float("nan")
    return out


def evaluate_models(models: dict[str, torch.Tensor], assign: np.ndarray, ctx: RunContext,
                    clients: Optional[np.ndarray] = None) -> dict[str, Any]:
    """Per-client test metrics with each client's own model, and their summaries.

    ``assign`` gives the model of every client (all ``ctx.num_clients``); the metrics cover
    ``clients`` (default: all). ``_assignment`` in the result covers every client."""
    clients = np.arange(ctx.num_clients) if clients is None else np.asarray(clients, np.int64)
    mine = assign[clients]
    c_loss, c_acc, n = own_cluster_metrics(ctx.model, models, mine, ctx.data.test, clients, ctx.data.task)
    out: dict[str, Any] = summarise_clients(c_loss, c_acc, n, ctx.data.task)
    out.update(cluster_breakdown(ctx, clients, mine, c_loss, c_acc, n, next(iter(models.values())).shape[0]))
    if "theta" in ctx.truth:
        out["min_dist"] = min_dist(models, ctx.truth["theta"])
    out["_client_accuracy"] = c_acc if ctx.data.task == "classification" else None
    out["_client_loss"] = c_loss
    out["_assignment"] = assign
    return out


def cluster_breakdown(ctx: RunContext, clients: np.ndarray, mine: np.ndarray, c_loss: np.ndarray, c_acc: np.ndarray,
                      n: np.ndarray, k: int) -> dict[str, Any]:
    """Per-cluster client counts and accuracy (loss for regression), the number of clusters
    in use, and ARI/NMI of ``mine`` against the clients' current true groups (when known)."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    out: dict[str, Any] = {}
    key = "accuracy" if ctx.data.task == "classification" else "loss"
    vals = c_acc if key == "accuracy" else c_loss
    for j in range(k):
        m = (mine == j) & (n > 0)
        out[f"cluster/{j}/clients"] = int((mine == j).sum())
        if m.any():
            out[f"cluster/{j}/{key}"] = float((vals[m] * n[m]).sum() / n[m].sum())
    out["num_clusters"] = int(len(np.unique(mine)))
    group = ctx.data.group[clients]
    if (group >= 0).all() and len(np.unique(group)) > 1:
        out["ari"] = float(adjusted_rand_score(group, mine))
        out["nmi"] = float(normalized_mutual_info_score(group, mine))
    return out


def own_cluster_metrics(model: nn.Module, models: dict[str, torch.Tensor], which: np.ndarray, split, clients: np.ndarray,
                        task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean loss and accuracy of every listed client under model ``which[i]`` only: one pass per
    model over its own clients (with k ≥ clients, e.g. local training, never k × clients)."""
    c_loss, c_acc, n = np.zeros(len(clients)), np.zeros(len(clients)), np.zeros(len(clients), np.int64)
    which = np.maximum(which, 0)
    for j in np.unique(which):
        one = {k: v[int(j) : int(j) + 1] for k, v in models.items()}
        for pos in chunks(np.flatnonzero(which == j), EVAL_CHUNK):  # a bounded slice of the test data at a time
            loss, acc, cnt = client_model_losses(model, one, split, clients[pos], task)
            c_loss[pos], c_acc[pos], n[pos] = loss[0].numpy(), acc[0].numpy(), cnt.numpy()
    return c_loss, c_acc, n


@torch.no_grad()
def own_model_metrics(model: nn.Module, params: dict[str, torch.Tensor], split, clients: np.ndarray, task: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean loss and accuracy of every listed client under its own model (``params`` row i
    belongs to ``clients[i]``): returns ([C] loss, [C] accuracy, [C] sample counts)."""
    from torch.func import functional_call

    from flockfl.engine.functional import correct, per_sample_loss

    losses, accs, counts = [], [], []
    for i, c in enumerate(clients):
        x, y = split.client(int(c))
        counts.append(len(y))
        if len(y) == 0:
            losses.append(0.0)
            accs.append(0.0)
            continue
        out = functional_call(model, {k: v[i] for k, v in params.items()}, (x,))
        losses.append(float(per_sample_loss(out, y, task).mean()))
        accs.append(float(correct(out, y, task).mean()))
    return np.array(losses), np.array(accs), np.array(counts)


def min_dist(models: dict[str, torch.Tensor], theta: np.ndarray) -> float:
    """IFCA's metric: (1/k) Σ_j min_j' ‖θ_j − θ*_j'‖ for linear models."""
    w = next(iter(models.values())).reshape(next(iter(models.values())).shape[0], -1).double().cpu()
    t = torch.as_tensor(theta, dtype=torch.float64)
    return float(torch.cdist(w, t).min(1).values.mean())

