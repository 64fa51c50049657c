"""Curricula for federated learning (thesis Chapter 2; spec ``curriculum-and-pruning.md`` §1).

A stage that composes with any algorithm (config section ``curriculum``):

- **Data curriculum** (Algorithm 1): at the start of each round every selected client scores
  its own samples with the model it received (``s_G``; or its last local model, both, the
  prediction checks, or an expert), sorts them by ``ordering`` and trains on paced prefixes:
  local step t draws its batch from the first g(t) samples (``flockfl.engine.schedule.Pacing``).
  The spec's ``order`` and ``pacing`` carry this to both trainers as data; the number of
  local steps is the vanilla budget E·⌈n/B⌉.
- **Client curriculum** (§1.5): each round the federating clients are ranked by their score
  1/L_k (mean training loss under the global or expert model), the first g_client(t) form
  the pool (pacing over rounds: N = the federating clients, T = ``train.rounds``), and the
  cohort is ``train.clients_per_round`` clients drawn at random from that pool. It replaces
  the algorithm's own selection, once per round: under a multi-cycle algorithm (FedCluster's
  M cycles) the cohort is drawn in the round's first cycle (scores under the models the round
  starts from) and the cycles split it, cycle K training the cohort's members of the clients
  it would draw from (FedCluster: cluster σ_j(K); ``flockfl.rounds.cycle_share``). So the
  curriculum's cohort is the same whatever the algorithm (the paced pool, one mini-batch of
  clients per round), every one of its clients trains once in the round, and the algorithm
  keeps its own structure (cluster order, M sequential updates); restricting each cycle's own
  draw to the pool instead would shrink the early rounds' cohorts by the pool's share and
  leave clients of the cohort untrained. The three choices the seed leaves open (pool over all
  clients; one mini-batch of clients per round; L_k computed by each client and sent as one
  scalar) are recorded in ``state.meta['curriculum']``.

A data curriculum needs mini-batches to pace: under an algorithm that trains each client on
one full batch (FedSGD; IFCA option I, refused when validated) or in closed form (FedSplit's
exact prox) it would be a no-op, so the first such round stops with a one-line ConfigError
(``train.full_batch=true`` is refused when the config is validated).

Scores are recomputed every round. The pacing clock runs over each round's local steps
(``pacing_scope=round``, Algorithm 1) or over the whole run (``global``). Ties (the binary
``*_pred`` scores) are broken by a uniform key from the (seed, round, client, "curriculum")
stream. The per-round ``difficulty_std`` is the mean over the cohort of the standard
deviation of each client's per-sample losses under the scoring model (the consistency
measure of §1.6; low std = high consistency; over a multi-cycle round, the mean over all the
cycles' clients).

State: ``s_L`` needs each client's last local model; with ``local_model=persisted`` those
rows live in ``state.algo['curriculum']`` (one model per client that has trained).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
from torch.func import functional_call

from flockfl.engine.functional import per_sample_loss
from flockfl.engine.pacing import Pacing, pacing_size
from flockfl.engine.schedule import LocalSpec
from flockfl.rng import np_rng
from flockfl.clientstate import ClientTable
from flockfl.errors import ConfigError
from flockfl.evaluation import own_cluster_metrics
from flockfl.stages.base import Stage, log_mean
from flockfl.state import log_round

EPS = 1e-8


class Curriculum(Stage):
    """The ``curriculum`` section, bound to one run."""

    name = "curriculum"
    paper = ("Vahidian et al., When Do Curricula Work in Federated Learning? (ICCV 2023; thesis Chapter 2)")

    @classmethod
    def active(cls, cfg) -> bool:
        return cfg.curriculum.ordering != "vanilla" or cfg.curriculum.clients

    def __init__(self, cfg, model=None):
        self.cfg = cfg
        self.c = cfg.curriculum

    @property
    def data_on(self) -> bool:
        return self.c.ordering != "vanilla"

    @property
    def clients_on(self) -> bool:
        return self.c.clients

    @property
    def on(self) -> bool:
        return self.data_on or self.clients_on

    def choices(self) -> dict:
        """What this run decided where the seed is silent (logged with the state)."""
        out = {"ordering": self.c.ordering, "scoring": self.c.scoring, "pacing": self.c.pacing, "a": self.c.a,
               "b": self.c.b, "pacing_scope": self.c.pacing_scope, "pacing_literal": self.c.pacing_literal,
               "batch_draw": "distinct samples uniformly from the paced prefix at every step",
               "local_steps": "E·ceil(n/B) (the vanilla budget)"}
        if self.clients_on:
            out.update({"client_ordering": self.client_ordering, "client_scoring": self.c.client_scoring,
                        "client_pool": "every federating client, paced over rounds (N = clients, T = train.rounds)",
                        "client_batch": "one random mini-batch of train.clients_per_round clients from the pool per round",
                        "client_loss": "computed by each client over its training data, sent as one scalar"})
        return out

    @property
    def client_ordering(self) -> str:
        return self.c.client_ordering or (self.c.ordering if self.c.ordering != "vanilla" else "curr")

    # ------------------------------------------------------------------ models
    def input_files(self) -> dict[str, str]:
        """θ_E, when s_E scores with a model of its own (``expert=global``: the server's model)."""
        c = self.c
        if c.expert == "global" or not (c.scoring == "s_E" or (c.clients and c.client_scoring == "s_E")):
            return {}
        return {"curriculum.expert": c.expert}

    def expert(self, ctx) -> dict[str, torch.Tensor]:
        """θ_E as a parameter dict (``curriculum.expert``, read by the run's preparation)."""
        return ctx.inputs["curriculum.expert"]

    # ------------------------------------------------------------------ client curriculum
    # ------------------------------------------------------------------ stage hooks
    @property
    def replaces_cohort(self) -> bool:
        return self.clients_on

    def select(self, ctx, state, algorithm, clients: np.ndarray, round: int) -> np.ndarray:
        """A client curriculum replaces the algorithm's draw (once per round; the cycles of a
        multi-cycle round split it)."""
        if not self.clients_on:
            return clients
        clients, counts = self.cohort(ctx, state, algorithm, round)
        log_round(state, **counts)
        return clients

    def on_spec(self, ctx, state, spec: LocalSpec, round: int) -> LocalSpec:
        """Scores with the model each client received, then paced batches."""
        if self.data_on and len(spec.clients):
            self.check_paceable(ctx, spec)
            spec, counts = self.apply(ctx, state, spec, round)
            log_mean(state, len(spec.clients), **counts)
        if "curriculum" not in state.meta:
            state.meta = {**state.meta, "curriculum": self.choices()}
        return spec

    def after_aggregate(self, state, result) -> None:
        self.remember(state, result)

    # ------------------------------------------------------------------ the curricula
    def cohort(self, ctx, state, alg, round: int) -> tuple[np.ndarray, dict]:
        """The cohort of a client-curriculum round, and the counts to log."""
        pool_all = ctx.seen
        if self.c.client_scoring == "s_E" and self.c.expert != "global":
            models = {k: v.unsqueeze(0) for k, v in self.expert(ctx).items()}
            which = np.zeros(len(pool_all), np.int64)
        else:
            models = state.models
            which = np.maximum(state.assignments[pool_all], 0)
        loss = client_losses(ctx, models, which, pool_all)
        score = 1.0 / (loss + EPS)
        rng = np_rng(ctx.seed, round, purpose="client_curriculum")
        ranked = rank(score, self.client_ordering, rng)
        total = self.cfg.train.rounds
        size = pacing_size(self.c.pacing, round, len(pool_all), total, self.c.a, self.c.b, self.c.pacing_literal)
        pool = pool_all[ranked[:size]]
        k = min(self.cfg.train.clients_per_round, len(pool))
        cohort = np.sort(pool[rng.choice(len(pool), size=k, replace=False)])
        return cohort, {"client_pool": int(size)}

    # ------------------------------------------------------------------ data curriculum
    @staticmethod
    def check_paceable(ctx, spec: LocalSpec) -> None:
        """A data curriculum paces mini-batches: a spec that trains on full batches or in closed
        form has none, and the curriculum would silently do nothing."""
        if spec.full_batch or spec.solver is not None:
            how = ("with its own local solver (not paced SGD steps)" if spec.solver is not None
                   else "on one full batch per step")
            raise ConfigError(f"curriculum.ordering: a data curriculum paces mini-batches, but algorithm.name="
                              f"{ctx.cfg.algorithm.name} trains each client {how}; use curriculum.ordering=vanilla "
                              "(a client curriculum, curriculum.clients=true, still applies) or a mini-batch algorithm")

    def apply(self, ctx, state, spec: LocalSpec, round: int) -> tuple[LocalSpec, dict]:
        """Give ``spec`` each client's curriculum order and the pacing; returns the counts to log."""
        if not len(spec.clients):
            return spec, {}
        order, stds = [], []
        losses = self.sample_losses(ctx, state, spec)
        for i, c in enumerate(spec.clients):
            rng = np_rng(ctx.seed, round, int(c), "curriculum")
            score = losses[i]
            stds.append(float(np.std(score[1])) if len(score[1]) else 0.0)
            order.append(rank(score[0], self.c.ordering, rng))
        pacing = Pacing(self.c.pacing, self.c.a, self.c.b, self.c.pacing_literal)
        if self.c.pacing_scope == "global":
            steps = self._budget(ctx, spec)
            pacing = Pacing(self.c.pacing, self.c.a, self.c.b, self.c.pacing_literal, offset=round * steps,
                            total=self.cfg.train.rounds * steps)
        return dataclasses.replace(spec, order=order, pacing=pacing), {"difficulty_std": float(np.mean(stds))}

    def _budget(self, ctx, spec: LocalSpec) -> int:
        """Local steps per round for the global clock: E·⌈n̄/B⌉ with n̄ the mean size of the
        federating clients (the same every round), or the fixed local steps."""
        if spec.steps is not None:
            return int(spec.steps)
        n = float(np.mean(ctx.data.train.sizes[ctx.seen]))
        return int(spec.epochs * np.ceil(n / max(1, spec.batch_size)))

    def sample_losses(self, ctx, state, spec: LocalSpec) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per client: (score to rank by, higher = easier; the per-sample losses behind it)."""
        s = self.c.scoring
        split, task = ctx.data.train, ctx.data.task
        received = [{k: v[i] for k, v in spec.init.items()} for i in range(len(spec.clients))]
        out = []
        for i, c in enumerate(spec.clients):
            x, y = split.client(int(c))
            if len(y) == 0:
                out.append((np.zeros(0), np.zeros(0)))
                continue
            # s_E scores with the expert (with expert=global, the current server model: s_G)
            scorer = self.expert(ctx) if s == "s_E" and self.c.expert != "global" else received[i]
            lg, pg = _loss_pred(ctx, scorer, x, y, task)
            if s in ("s_G", "s_E"):
                out.append((1.0 / (lg + EPS), lg))
                continue
            if s == "s_G_pred":
                out.append(((pg == y.cpu().numpy()).astype(float), lg))
                continue
            local = self.local_model(state, int(c), x.device) or received[i]
            ll, pl = _loss_pred(ctx, local, x, y, task)
            if s == "s_L":
                out.append((1.0 / (ll + EPS), ll))
            elif s == "s_LG":
                out.append((1.0 / ((ll + lg) / 2 + EPS), (ll + lg) / 2))
            elif s == "s_L_pred":
                out.append(((pl == y.cpu().numpy()).astype(float), ll))
            else:  # s_LG_pred: hard when the local and global predictions differ
                out.append(((pl == pg).astype(float), (ll + lg) / 2))
        return out

    # ------------------------------------------------------------------ s_L's local models
    @property
    def keeps_local(self) -> bool:
        return self.data_on and self.c.scoring in ("s_L", "s_LG", "s_L_pred", "s_LG_pred") and self.c.local_model == "persisted"

    def local_model(self, state, client: int, device=None) -> Optional[dict[str, torch.Tensor]]:
        table = (state.algo.get("curriculum") or {}).get("models")
        if not self.keeps_local or table is None or not table.written([client])[0]:
            return None
        return {k: v[0] for k, v in table.gather([client], device).items()}

    def remember(self, state, result) -> None:
        """Keep each trained client's final local model (for s_L next time it is selected), in a
        :class:`~flockfl.clientstate.ClientTable` (rows of the clients that trained)."""
        if not self.keeps_local:
            return
        table = (state.algo.get("curriculum") or {}).get("models")
        if table is None:
            table = ClientTable(len(state.assignments), {k: torch.zeros_like(v[0]) for k, v in result.params.items()})
        state.algo = {**state.algo, "curriculum": {"models": table.scatter(result.clients, result.params)}}


def rank(score: np.ndarray, ordering: str, rng: np.random.Generator) -> np.ndarray:
    """Indices in curriculum order: ``curr`` highest score (easiest) first, ``anti`` lowest
    first, ``random`` a permutation; ties broken by a uniform key from ``rng``."""
    n = len(score)
    tie = rng.random(n)
    if ordering == "random":
        return rng.permutation(n)
    if ordering == "anti":
        return np.lexsort((tie, score))
    return np.lexsort((tie, -score))


@torch.no_grad()
def _loss_pred(ctx, params: dict[str, torch.Tensor], x, y, task) -> tuple[np.ndarray, np.ndarray]:
    out = functional_call(ctx.model, params, (x,))
    loss = per_sample_loss(out, y, task).cpu().numpy().astype(np.float64)
    pred = out.argmax(-1).cpu().numpy() if task == "classification" else np.zeros(len(y))
    return loss, pred


@torch.no_grad()
def client_losses(ctx, models: dict[str, torch.Tensor], which: np.ndarray, clients: np.ndarray) -> np.ndarray:
    """L_k (Eq. 2.1): each client's mean training loss under model ``which[i]``."""
    loss, _, _ = own_cluster_metrics(ctx.model, models, which, ctx.data.train, clients, ctx.data.task)
    return loss


