"""The algorithm interface: pure hooks over (state, inputs), whose defaults are FedAvg.

The round, in the order the driver (``flockfl/rounds.py``) calls them:

- ``init_state(ctx)`` → the round-0 :class:`ServerState`; ``pre_federation(state, ctx)``: a
  one-shot step before round 0 (PACFL's signatures, FLIS-HC's clustering), run once;
- ``select(state, ctx, round)`` → the cohort; ``before_training``: scheduling that reacts to the
  data (FlexCFL's migration);
- ``local_spec(state, ctx, clients, round)`` → a :class:`LocalSpec` (where each client starts —
  ``model_of`` —, its local work — ``local_work`` —, the method's terms);
- ``cluster(state, ctx, spec, result)`` → the cluster of each trained client;
- ``aggregate(state, ctx, spec, result, assign)`` → the new ``ServerState``;
- ``evaluate(state, ctx)`` → per-client and summary metrics (each client's ``eval_assignment``
  model, or under ``personal`` its ``own_models`` row); ``finetune`` and ``admit_newcomers`` for
  the "after local training" convention and the clients that join after federation.

Rarer rounds: ``cycles_per_round`` and ``cycle_candidates`` (FedCluster's sub-rounds),
``companion_spec`` and ``absorb_companions`` (pFedMe's unsampled clients), ``shift_pool``.
Around the run: ``check_config`` and ``notes`` (at validation), ``input_files`` (files the
preparation reads), ``comm_bytes`` and ``sim_round_time`` (accounting).

``cluster`` returns ids of ``state.models`` (``cluster_ids_are_models``) except where a method
regroups its clients every round (FLIS-DC: this round's groups become the new models). A method
that splits clusters from this round's updates (CFL) does so in ``aggregate``: the stages'
``before_aggregate`` (the pruning stage's masked fill, which indexes the models by cluster) runs
between the two hooks and changes the updates the split must test.

A subclass overrides only what differs from FedAvg. Hooks never touch files, Prefect or
MLflow; the flow (``flows/experiment.py``) calls them through thin tasks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flockfl.aggregation import broadcast, mean_weights, rows, weighted_mean
from flockfl.algorithms.hyper import Hyper, declared, weighting
from flockfl.client import finetune_epochs, pass_spec, round_spec, train_pass
from flockfl.clientstate import chunks
from flockfl.config import ExperimentConfig
from flockfl.context import RunContext
from flockfl.engine.functional import index_params, num_params, stack
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.eval_protocol import ClientMetrics
from flockfl.evaluation import client_results, cluster_breakdown, evaluate_models, measure_own
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from models import init_params


class Algorithm:
    """FedAvg (McMahan et al., arXiv 1602.05629): E local epochs of SGD, sample-weighted mean."""

    name = "fedavg"
    family = "global"  # global | clustered | personalised: how `flockfl list` groups methods
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, arXiv 1602.05629"
    # the algorithm.* keys this class reads (a subclass adds or redeclares; see hyper.py)
    hyperparameters: tuple[Hyper, ...] = (weighting("samples"),)
    # top-level keys of ``state.algo`` whose tensors live on the run's device (with the models):
    # a resumed run moves them back there (see ``flockfl.state.on_device``); dicts keyed by
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

    # the ids ``cluster`` returns index ``state.models`` (False: this round's own groups, which
    # ``aggregate`` turns into the new models; FLIS-DC): a stage that reads the server's model of
    # a client's cluster before ``aggregate`` (pruning's masked fill) refuses such a method
    cluster_ids_are_models = True

    # the algorithm.k at which this method is FedAvg (one cluster, one model): it still runs (a
    # legitimate limit, e.g. a sanity check), and says so (:meth:`notes`)
    one_cluster_is_fedavg = False

    @classmethod
    def notes(cls, cfg: ExperimentConfig) -> list[str]:
        """What a valid configuration makes of this method that a reader of its results must know
        (a legitimate limit where it becomes another method): shown in the run's summary and on
        its MLflow run (``flockfl.notes``)."""
        k = getattr(cfg.algorithm, "k", None)
        if cls.one_cluster_is_fedavg and isinstance(k, int) and k == 1:
            return [f"algorithm.k=1: one cluster, so {cls.name} runs as FedAvg (set algorithm.k >= 2 to cluster)"]
        return []

    def input_files(self) -> dict[str, str]:
        """The files this configuration needs, ``algorithm.*`` key → path (IFCA's init=given):
        the run's preparation reads each (``torch.load``) into ``ctx.inputs[key]``."""
        return {}

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

    def companion_spec(self, state: ServerState, ctx: RunContext, spec: LocalSpec, round: int) -> LocalSpec | None:
        """Clients that train this round from the same broadcast ``state`` as the cohort ``spec``
        but do not enter the aggregate (pFedMe's unsampled clients under ``train_all_clients``).
        After the cohort's aggregate the driver trains them through the same train stage
        (sharded, retried, distributed by the executor), a chunk at a time, and folds each
        chunk's result into the new state with :meth:`absorb_companions`, so memory holds one
        chunk's models, never all of them. None: no such clients."""
        return None

    def absorb_companions(self, state: ServerState, ctx: RunContext, result: TrainResult) -> ServerState:
        """The state with one chunk of companions' training (``companion_spec``) folded in."""
        raise NotImplementedError(f"{self.name} names companions but does not absorb them")

    def cycle_candidates(self, state: ServerState, ctx: RunContext, round: int) -> np.ndarray | None:
        """The clients the running cycle of a multi-cycle round draws from (FedCluster: cluster
        σ(K)); a stage that chose the round's cohort once has each cycle train the cohort's
        members among them. None: the cycle's own draw."""
        return None

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
            init = broadcast(state.models, len(clients))
        else:
            init = index_params(state.models, torch.from_numpy(which))
        return round_spec(t, clients, init, meta={"model_of_client": which}, client_epochs=self.local_work(ctx, clients, round))

    def local_work(self, ctx: RunContext, clients: np.ndarray, round: int) -> np.ndarray | None:
        """Per-client epochs when ``train.local_work=uniform_random`` (E_i ~ U{1..E})."""
        t = self.cfg.train
        if t.local_work == "constant":
            return None
        return np.array([np_rng(ctx.seed, round, int(c), "local_work").integers(1, t.local_epochs + 1) for c in clients])

    def pseudo_gradient(self, state: ServerState, result: TrainResult) -> dict[str, torch.Tensor]:
        """Δ = Σ_i p_i (x − x_i) over the trained clients (positive in the descent direction),
        with p_i from ``algorithm.weighting``."""
        mean = weighted_mean(result.raw_params, self.weights(result, np.arange(len(result.clients))))
        return {k: v[0] - mean[k].reshape(v[0].shape) for k, v in state.models.items()}

    def cluster(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult) -> np.ndarray:
        """The cluster of each trained client: the model it started from."""
        pos = {int(c): i for i, c in enumerate(spec.clients)}
        return np.array([spec.meta["model_of_client"][pos[int(c)]] for c in result.clients], np.int64)

    def weights(self, result: TrainResult, members: np.ndarray) -> torch.Tensor:
        """p_i of the listed members (float32, summing to 1), on the device of the trained parameters."""
        return mean_weights(result.num_samples[members], self.weighting, next(iter(result.raw_params.values())).device)

    def aggregate(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult,
                  assign: np.ndarray) -> ServerState:
        """Per model j: the weighted mean of the clients that trained it; untouched if none did."""
        models = {k: v.clone() for k, v in state.models.items()}
        for j in range(state.k):
            members = np.flatnonzero(assign == j)
            if len(members) == 0:
                continue
            everyone = len(members) == len(result.clients)
            # everyone: a low-rank layer's weight is averaged on its factors (TrainResult.raw_params)
            mean = weighted_mean(result.raw_params if everyone else rows(result.params, members), self.weights(result, members))
            for k in models:
                models[k][j] = mean[k]
        return self._with_assignments(state, models, result.clients, assign)

    def _with_assignments(self, state: ServerState, models: dict, clients: np.ndarray, assign: np.ndarray) -> ServerState:
        assignments = state.assignments.copy()
        assignments[clients] = assign
        return state.replace(models=models, assignments=assignments)

    # ------------------------------------------------------------------ evaluation
    # True: every client is measured with its own model (``own_models``: FedAC's ω_i, DIFCA's
    # reference copies) instead of the model ``eval_assignment`` gives it
    personal = False
    # fine-tuning runs with train.momentum (FedAC's never has)
    finetune_momentum = True

    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        """The model each client uses at evaluation (the single global model by default)."""
        return np.zeros(ctx.num_clients, np.int64)

    def own_models(self, state: ServerState, ctx: RunContext, clients: np.ndarray, assign: np.ndarray
                   ) -> dict[str, torch.Tensor]:
        """Stacked parameters, row i those of ``clients[i]`` when it is assigned model ``assign[i]``:
        where its fine-tuning starts, and what a ``personal`` evaluation measures. The assigned
        model by default."""
        assign = np.asarray(assign, np.int64)
        if (assign < 0).any():  # index -1 would silently pick the last model
            raise ValueError(f"{self.name}.finetune: clients {np.asarray(clients)[assign < 0].tolist()} have no model; "
                             "an algorithm with unassigned clients must override own_models")
        return index_params(state.models, torch.from_numpy(assign))

    def evaluate(self, state: ServerState, ctx: RunContext) -> dict[str, Any]:
        """Per-client metrics of the clients that federate, each with its own model: the one
        ``eval_assignment`` gives it, or (``personal``) its ``own_models`` row, 256 clients at a time."""
        assign = self.eval_assignment(state, ctx)
        if not self.personal:
            return evaluate_models(state.models, assign, ctx, ctx.seen)
        clients = ctx.seen
        cm = ClientMetrics.join(measure_own(ctx, self.own_models(state, ctx, part, assign[part]), part)
                                for part in chunks(clients, 256))
        return client_results(ctx, cm, assign, lambda t: self.cluster_metrics(state, ctx, clients, assign[clients], *t))

    def cluster_metrics(self, state: ServerState, ctx: RunContext, clients: np.ndarray, mine: np.ndarray,
                        c_loss: np.ndarray, c_acc: np.ndarray, n: np.ndarray) -> dict[str, Any]:
        """A personal evaluation's per-cluster part: counts, accuracy (loss), ARI/NMI."""
        return cluster_breakdown(ctx, clients, mine, c_loss, c_acc, n, state.k)

    def admit_newcomers(self, state: ServerState, ctx: RunContext, newcomers: np.ndarray
                        ) -> tuple[ServerState, np.ndarray, str]:
        """After federation, clients that never trained join: (state, the model index of each
        newcomer, the rule in words). FedAvg gives them the global model."""
        return state, self.eval_assignment(state, ctx)[newcomers], "the global model"

    def finetune(self, state: ServerState, ctx: RunContext, clients: np.ndarray, assign: np.ndarray, round: int,
                 stream: str) -> TrainResult:
        """``train.finetune_epochs`` epochs of plain local SGD for each listed client, from
        its ``own_models`` row (the thesis's "after its last local training" convention)."""
        t = self.cfg.train
        clients = np.asarray(clients, np.int64)
        init = self.own_models(state, ctx, clients, np.asarray(assign, np.int64))
        spec = pass_spec(t, clients, init, finetune_epochs(t), stream=stream, momentum=t.momentum if self.finetune_momentum else 0.0)
        return train_pass(ctx, spec, round)

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


