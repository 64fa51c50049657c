"""DIFCA — decentralised IFCA: Kirch, "Decentralized Federated Learning: Enhancing IFCA for
Efficient Clustered Model Training" (TU Dortmund, 2024; seed ``002_643bde2a8bf6ff78.txt``,
Algorithm 1), built on IFCA (Ghosh et al., https://arxiv.org/abs/2006.04088). Later reference
code: jonaskir6/dfca ("DFCA"). Spec: ``core-and-clustered-algorithms.md`` §2.3.

A light server publishes k initial models θ_j^(0) and the contact list once, hands out tokens
and listens; it never averages. Every round, each participant i ∈ M:

1. evaluates all k representatives on its training data, picks ĵ_i = argmin_j F_i(θ_j)
   (ties → lowest index) and broadcasts ĵ_i, so every peer list L_i knows every cluster;
2. trains θ̃_i = LocalUpdate(θ_ĵ, γ, τ) as IFCA option II (``train.*``);
3. gossips: ``algorithm.partners`` R repeats of a *symmetric* pairwise exchange with
   same-cluster participants — both partners take the average at once, which conserves the
   cluster's mean (``gossip=random_pairs``: in each repeat every member, in turn, averages with
   a peer drawn uniformly from the other members, peers may repeat; ``gossip=matching``: each
   repeat is a random perfect matching of the members, one left out when they are odd).
   ``gossip_weighting=uniform`` is the seed's (θ_i + θ_j)/2; ``samples`` is
   (n_iθ_i + n_jθ_j)/(n_i + n_j), after which the pair holds n_i + n_j samples between them,
   (n_i + n_j)/2 each. (The spec writes n ← n_i + n_j for both; giving each half keeps the
   cluster's total weight and its n-weighted mean fixed, so that R → ∞ reaches IFCA's
   ``weighting=samples`` aggregate.)
4. the server gives one token to a random member of each non-empty cluster; the token
   holder broadcasts its model and becomes the representative θ_c^(t+1). A cluster nobody
   chose keeps its model. With R = 0 the representative is the holder's own local model.

With R → ∞ every member reaches the cluster mean, so DIFCA becomes IFCA option II.

Participants (``algorithm.participation``): ``fixed`` (the seed's M, fixed for the run:
``train.clients_per_round`` clients drawn once from the (seed, "difca/participants") stream,
all federating clients when it equals them) or ``sampled`` (a new cohort every round, as IFCA).

``algorithm.dfca_variant`` selects the reference code's algorithm instead of the seed's: ``none``
(default) is the seed's algorithm above; ``reference_gi`` / ``reference_li`` (every client keeps all
k models, gossip with any participant) are described in ``difca_reference.py``.

Inference (``algorithm.inference``): ``loss`` picks argmin training loss (IFCA's rule);
``confidence`` picks ĵ = argmax_j (1/|X|) Σ_{x∈X} max_c softmax(f_θj(x))_c on the client's
*test inputs* X (the data to be labelled; no labels are read; the training inputs when a
client has no test data) — the seed's "confidence based inference". Training always uses
the loss rule (the clients have labels).

Communication. Server bytes (``comm_bytes``): the initial publication (k models to each
participant of round 0; none for ``reference_li``) and one model per token holder each round.
Peer-to-peer bytes go to the round's row as ``bytes_p2p``: 2 models per gossip exchange
(``gossip_exchanges``); for the seed's variant also the cluster identities broadcast
(|M|(|M| − 1) int64) and each token holder's model to the other |M| − 1 participants.

State: the k representatives (``models``), the last cluster of every client (``assignments``:
every peer list L_i, as the identities are broadcast to all), ``algo['participants']`` (M, fixed
participation) and ``algo['token_holder']`` (each cluster's token holder in round
``algo['token_round']``, −1 for none). Random streams: (seed, round, cluster, "difca/gossip"),
(seed, round, cluster, "difca/token").

IFCA's keys apply as in IFCA: ``k``, ``init`` and the keys of its options (``init_path``,
``min_cluster_frac``, ``max_tries``, ``pretrain_*``) give the server's θ_j^(0); under
``reference_gi`` every client's copies start from them, under ``reference_li`` only the
representatives do. ``init`` defaults to ``random``, the seed's start: the light server
publishes k initial models and the contact list (Alg. 1 l.1) and has no step before round 0, so
nothing is uploaded or clustered centrally. ``init=pretrain_kmeans`` (IFCA's library start: a
cohort uploads trained models and the server runs k-means before round 0) stays available as
an option, but it is a central step that DIFCA as published does not have ("DIFCA + k-means
start" in tables). DIFCA narrows ``option`` to ``model`` (IFCA option II), ``weighting`` to
``uniform`` (there is no server mean) and ``shared`` to ``none``.
"""

from __future__ import annotations

import dataclasses

from typing import Any

import numpy as np
import torch

from flockfl.aggregation import flatten, unflatten
from flockfl.algorithms.difca_reference import client_copies
from flockfl.algorithms.hyper import Hyper, choice, declared, integer, sourced
from flockfl.algorithms.ifca import IFCA
from flockfl.algorithms.model_choice import (assign_by_max_confidence, assign_by_min_loss, cluster_losses,
                                             confidence_scores)
from flockfl.client import round_spec
from flockfl.clustering.gossip import pairwise_gossip, pick_tokens
from flockfl.context import RunContext
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.errors import ConfigError
from flockfl.rng import np_rng
from flockfl.state import ServerState, log_round

VARIANTS = ("none", "reference_gi", "reference_li")


def gossip(params: dict[str, torch.Tensor], sizes: np.ndarray, repeats: int, mode: str, weighting: str,
           rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], int]:
    """:func:`~flockfl.clustering.gossip.pairwise_gossip` on stacked parameters (the local models of
    one cluster's members): (the mixed models, the number of exchanges)."""
    flat = flatten(params)  # a fresh tensor
    exchanges = pairwise_gossip(flat, sizes, repeats, mode, weighting, rng)
    return unflatten(flat, params), exchanges


class DIFCA(IFCA):
    name = "difca"
    paper = ("Kirch, Decentralized Federated Learning: Enhancing IFCA for Efficient Clustered Model Training "
             "(seed 002, 2024), on IFCA (arXiv 2006.04088)")
    hyperparameters = (
        choice("weighting", "uniform", ("uniform",), "unused: DIFCA has no server mean (the gossip's weights are "
               "algorithm.gossip_weighting)", "p_i", source="paper", note="seed 002: the server never averages"),
        dataclasses.replace(sourced(declared(IFCA)["k"], "library", "seed 002 runs k = p = 4, its data's 4 rotations; "
                                    "2 as IFCA"), auto=False, meaning="number of cluster models"),
        choice("option", "model", ("model",), "local update: IFCA option II (τ local steps, train.*); option I is not "
               "defined for DIFCA", source="paper", note="seed 002, Alg. 1 l.11: LocalUpdate(θ_ĵ, γ, τ)"),
        sourced(declared(IFCA)["init"], "paper", "seed 002, Alg. 1 l.1: the server publishes k initial models; no "
                "step before round 0 (pretrain_kmeans would be a central upload and k-means)"),
        Hyper("shared", "none", "weight sharing: none (IFCA's shared trunk needs a mean over all participants, which "
              "DIFCA's per-cluster gossip does not form)", kind="choice", choices=("none",), source="paper",
              note="seed 002 shares no weights"),
        integer("partners", 10, "gossip repeats per round: exchanges with same-cluster peers (0: the token holder's "
                "own model is the representative)", "R", ge=0, source="library",
                note="seed 002 leaves R open ('Determine number of exchanges per epoch')"),
        choice("gossip", "random_pairs", ("random_pairs", "matching"), "who exchanges in a repeat: every member with a "
               "uniformly drawn same-cluster peer (random_pairs), or a random perfect matching (matching)",
               source="library", note="seed 002 l.17: peer_exchange with a same-cluster peer, drawn how is not said"),
        choice("gossip_weighting", "uniform", ("uniform", "samples"), "exchange average: (θ_i+θ_j)/2 (uniform, the "
               "seed) or n-weighted (samples, n_i exchanged with θ_i)", "n_i", source="paper",
               note="seed 002, Alg. 1 l.18: (θ_i + θ_j)/2"),
        choice("dfca_variant", "none", VARIANTS, "none: the seed's algorithm; reference_gi / reference_li: the reference "
               "code's (every client keeps all k models, random partner counts, any-cluster partners, α=0.5/0.4), "
               "with shared (gi) or per-client (li) initial models", source="paper", note="seed 002, Alg. 1"),
        choice("inference", "loss", ("loss", "confidence"), "evaluation's model choice: argmin training loss (loss) or "
               "argmax mean max-softmax on the client's unlabelled test inputs (confidence)", source="paper",
               note="seed 002, Alg. 1 l.7-8 choose by loss; its 'confidence based inference' bullet is "
                    "inference=confidence (the formula is the library's reading)"),
        choice("participation", "fixed", ("fixed", "sampled"), "participants: a set M of train.clients_per_round "
               "clients fixed for the run (fixed, the seed) or a new cohort every round (sampled)", "M",
               source="paper", note="seed 002, Alg. 1 l.3: M, fixed for the run"),
    )

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        a = cfg.algorithm
        if a.inference == "confidence" and cfg.dataset.name == "synthetic_linreg":
            raise ValueError("algorithm.inference: confidence needs class probabilities; synthetic_linreg is a "
                             "regression task (use inference=loss)")
        if a.dfca_variant != "none" and (a.gossip != "random_pairs" or a.gossip_weighting != "uniform"):
            raise ValueError(f"algorithm.dfca_variant: {a.dfca_variant} gossips as the reference code (α = 0.5/0.4); "
                             "gossip and gossip_weighting apply to dfca_variant=none only")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.copies = client_copies(self.hp("dfca_variant"))  # None: the seed's variant, no client copies

    @property
    def personal(self) -> bool:
        """The reference variants evaluate every client with its own copy of the model it chooses."""
        return self.copies is not None

    @property
    def publishes(self) -> bool:
        """The server sends the k initial models to round 0's participants (not under reference_li)."""
        return self.copies is None or self.copies.shared_init

    # ------------------------------------------------------------------ participants
    def participants(self, ctx: RunContext) -> np.ndarray:
        """The fixed set M: train.clients_per_round federating clients, drawn once."""
        k = min(self.cfg.train.clients_per_round, len(ctx.seen))
        if k == len(ctx.seen):
            return ctx.seen.copy()
        rng = np_rng(ctx.seed, purpose="difca/participants")
        return np.sort(ctx.seen[rng.choice(len(ctx.seen), size=k, replace=False)])

    def select(self, state: ServerState, ctx: RunContext, round: int) -> np.ndarray:
        if self.hp("participation") == "sampled":
            return super().select(state, ctx, round)
        if "participants" in state.algo:
            return state.algo["participants"].numpy().copy()
        return self.participants(ctx)

    # ------------------------------------------------------------------ initialisation
    def init_state(self, ctx: RunContext) -> ServerState:
        state = super().init_state(ctx)
        algo: dict[str, Any] = {"token_holder": torch.full((self.num_models,), -1, dtype=torch.int64),
                                "token_round": torch.tensor(-1)}
        if self.hp("participation") == "fixed":
            algo["participants"] = torch.from_numpy(self.participants(ctx))
        if self.copies:
            algo["client_models"] = self.copies.initial(state, ctx, self.num_models, self.draw_model)
        return state.replace(algo=algo)

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """IFCA's pre-federation initialisation (init=pretrain_kmeans); under reference_gi every
        client's copies then start from the k models it produced."""
        new = super().pre_federation(state, ctx)
        return self.copies.after_pre_federation(new, ctx) if self.copies else new

    # ------------------------------------------------------------------ model choice
    def choose(self, state: ServerState, ctx: RunContext, clients: np.ndarray, rule: str) -> np.ndarray:
        """The model each listed client uses: argmin loss or argmax confidence, over the
        representatives (seed) or over the client's own copies (reference variants)."""
        clients = np.asarray(clients, np.int64)
        if rule == "confidence":
            if ctx.data.task != "classification":
                raise ConfigError("algorithm.inference: confidence needs class probabilities; this data is a regression "
                                  "task (use inference=loss)")
            conf = (self.copies.confidences(state, ctx, clients, self.num_models) if self.copies
                    else confidence_scores(ctx.model, state.models, ctx.data, clients))
            return assign_by_max_confidence(conf)
        losses = self.copies.losses(state, ctx, clients, self.num_models) if self.copies else cluster_losses(state, ctx, clients)
        return assign_by_min_loss(losses)

    # ------------------------------------------------------------------ hooks
    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        if not self.copies:
            spec = super().local_spec(state, ctx, clients, round)
        else:
            losses = self.copies.losses(state, ctx, clients, self.num_models)
            chosen = assign_by_min_loss(losses)
            spec = round_spec(self.cfg.train, clients, self.copies.own(state, clients, chosen),
                              meta={"model_of_client": chosen, "cluster_losses": losses},
                              client_epochs=self.local_work(ctx, clients, round))
        spec.meta["round"] = round
        return spec

    def aggregate(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult,
                  assign: np.ndarray) -> ServerState:
        """No server mean: gossip, then one token per non-empty cluster; the token holder's
        model becomes the cluster's representative."""
        round = int(spec.meta["round"])
        k, clients = state.k, np.asarray(result.clients, np.int64)
        token = pick_tokens(assign, k, ctx.seed, round)  # cohort positions
        holder = np.where(token >= 0, clients[np.maximum(token, 0)], -1)
        models = {name: v.clone() for name, v in state.models.items()}
        algo = {**state.algo, "token_holder": torch.from_numpy(holder), "token_round": torch.tensor(round)}
        mb = self.model_bytes(state)
        if self.copies:  # the holders' own copies become the representatives
            algo["client_models"], exchanges = self.copies.gossip_round(state, ctx, result, assign, round)
            for c in np.flatnonzero(holder >= 0):
                for name in models:
                    models[name][c] = algo["client_models"][name][int(holder[c]), int(c)]
            p2p = 2 * exchanges * mb
        else:
            exchanges = 0
            for c in np.flatnonzero(token >= 0):
                members = np.flatnonzero(assign == c)
                rows = torch.from_numpy(members).to(result.params[next(iter(models))].device)
                local = {name: result.params[name][rows] for name in models}
                rng = np_rng(ctx.seed, round, int(c), "difca/gossip")
                mixed, ex = gossip(local, result.num_samples[members], int(self.hp("partners")), self.hp("gossip"),
                                   self.hp("gossip_weighting"), rng)
                exchanges += ex
                t = int(np.flatnonzero(members == token[c])[0])
                for name in models:
                    models[name][c] = mixed[name][t]
            m = len(clients)
            # the gossip, the cluster identities broadcast, the holders' broadcast to the other participants
            p2p = 2 * exchanges * mb + m * (m - 1) * 8 + len(np.flatnonzero(token >= 0)) * (m - 1) * mb
        new = self._with_assignments(state, models, clients, assign)
        new = new.replace(algo=algo, meta={**new.meta, "difca_round": {
            "round": round, "bytes_p2p": int(p2p), "gossip_exchanges": int(exchanges), "participants": len(clients)}})
        log_round(new, bytes_p2p=int(p2p), gossip_exchanges=int(exchanges))
        return new

    # ------------------------------------------------------------------ evaluation
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return self.choose(state, ctx, np.arange(ctx.num_clients), self.hp("inference"))

    def own_models(self, state, ctx, clients, assign):
        """Reference variants: each client's own copy of the model it chooses."""
        return self.copies.own(state, clients, assign) if self.copies else super().own_models(state, ctx, clients, assign)

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer takes a representative, by the configured inference rule."""
        if self.hp("inference") == "confidence":
            conf = confidence_scores(ctx.model, state.models, ctx.data, np.asarray(newcomers, np.int64))
            return state, assign_by_max_confidence(conf), "most confident representative"
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "lowest-loss representative"

    # ------------------------------------------------------------------ accounting
    def comm_bytes(self, state: ServerState, clients: np.ndarray) -> tuple[int, int]:
        """(down, up) server bytes of the round: the initial publication (round 0, k models to
        each participant; none for reference_li), and the token holders' models to the server."""
        mb = self.model_bytes(state)
        down = len(clients) * state.k * mb if state.round == 0 and self.publishes else 0
        tokens = int((state.algo["token_holder"] >= 0).sum()) if int(state.algo["token_round"]) == state.round else 0
        up = tokens * mb
        return down, up

    def sim_round_time(self, state: ServerState, ctx: RunContext, clients: np.ndarray, steps: np.ndarray) -> float:
        """The slowest client's compute plus its transfers: the initial publication, its share
        of the peer-to-peer bytes each way, and one model up (a token holder)."""
        if len(clients) == 0:
            return 0.0
        mb = self.model_bytes(state)
        info = state.meta.get("difca_round", {})
        info = info if info.get("round") == state.round else {}
        p2p = info.get("bytes_p2p", 0) / max(info.get("participants", len(clients)), 1)
        down = (state.k * mb if state.round == 0 and self.publishes else 0) + p2p
        return ctx.system.round_time(clients, steps, down / 1e6, (mb + p2p) / 1e6)
