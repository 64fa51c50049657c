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

``algorithm.dfca_variant`` selects the reference code's algorithm instead of the seed's:

- ``none`` (default): the seed's algorithm above;
- ``reference_gi`` / ``reference_li``: every client keeps **all k models** locally, chooses by
  argmin loss over its own copies and trains its copy. Gossip is not restricted to a cluster:
  client i draws r_i ~ U{1, …, h−1} partners among all other participants, h = min(|M| − 1,
  50 if |M| > 800 else 15) (no gossip when h ≤ 1). Processing the clients in order, an
  exchange of i with j (clusters c_i, c_j; α = 0.5 if c_i = c_j, else 0.4) sets
  θ_{i,c_j} ← αθ_{i,c_j} + (1−α)θ_{j,c_j}, then θ_{j,c_i} ← αθ_{j,c_i} + (1−α)θ_{i,c_i}
  (in that order, with the updated θ_{i,c_i} when c_i = c_j, as the reference code does),
  and counts against j's draw too: j's list loses i if it holds i, else a random entry, and
  a peer whose list is already empty leaves every list. ``gi`` ("global init") gives every
  client the same k initial models; ``li`` ("local init") draws each client's k models
  independently (streams (seed, client, "difca/li/<j>")). Tokens and representatives work as
  above (the holder's copy of its cluster's model); evaluation and fine-tuning use each
  client's own copies. ``partners``, ``gossip`` and ``gossip_weighting`` do not apply.
  Memory: the copies live in ``state.algo['client_models']``, N × k × P floats for N clients
  and P parameters (e.g. 48 × 4 × 159 010 float32 ≈ 122 MB for the MNIST MLP 784-200-10);
  the seed's variant keeps no copies (k representatives only).

Inference (``algorithm.inference``): ``loss`` picks argmin training loss (IFCA's rule);
``confidence`` picks ĵ = argmax_j (1/|X|) Σ_{x∈X} max_c softmax(f_θj(x))_c on the client's
*test inputs* X (the data to be labelled; no labels are read; the training inputs when a
client has no test data) — the seed's "confidence based inference". Training always uses
the loss rule (the clients have labels).

Communication. Server bytes (``comm_bytes``): the initial publication (k models to each
participant of round 0; none for ``reference_li``, whose clients draw their own) and one model
per token holder to the server each round. Peer-to-peer bytes go to the round's row via
:func:`log_round` as ``bytes_p2p``: 2 models per gossip exchange; for the seed's variant also
the cluster identities broadcast (|M|(|M| − 1) int64) and each token holder's broadcast of its
model to the other |M| − 1 participants (how the clients receive next round's
representatives). ``gossip_exchanges`` counts exchanges.

State: the k representatives (``models``), the last cluster of every client
(``assignments``, which is every peer list L_i: the identities are broadcast to all),
``algo['participants']`` (M, fixed participation), ``algo['token_holder']`` (the client holding
each cluster's token in round ``algo['token_round']``, −1 for none) and, for the reference variants,
``algo['client_models']``. Random streams: (seed, round, cluster, "difca/gossip"), (seed, round,
cluster, "difca/token"), (seed, round, "difca/reference_partners").

Hyper-parameters. IFCA's keys apply as in IFCA: ``k`` (default 2), ``init`` and the keys of
its options (``init_path``, ``min_cluster_frac``, ``max_tries``, ``pretrain_*``: the server's
θ_j^(0); under ``reference_gi`` every client's copies start from them, under ``reference_li``
only the representatives do). DIFCA's own, and the IFCA keys it narrows:

======================  =================  ====================================  ======
key                     default            allowed                               symbol
======================  =================  ====================================  ======
``partners``            10                 integer ≥ 0                           R
``gossip``              ``random_pairs``   ``random_pairs``, ``matching``
``gossip_weighting``    ``uniform``        ``uniform``, ``samples``              n_i
``dfca_variant``        ``none``           ``none``, ``reference_gi``,
                                           ``reference_li``
``inference``           ``loss``           ``loss``, ``confidence``
``participation``       ``fixed``          ``fixed``, ``sampled``                M
``option``              ``model``          ``model`` (IFCA option II only)
``weighting``           ``uniform``        ``uniform`` (no server mean)          p_i
``shared``              ``none``           ``none`` (no weight sharing)
======================  =================  ====================================  ======
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flockfl.context import RunContext
from flockfl.evaluation import client_model_losses, cluster_breakdown, own_model_metrics, summarise_clients
from flockfl.state import log_round
from flockfl.algorithms.hyper import Hyper, choice, integer
from flockfl.algorithms.ifca import IFCA, assign_by_min_loss, cluster_losses
from flockfl.errors import ConfigError
from flockfl.engine.functional import segment_mean, stack, stacked_outputs
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from models import init_params

VARIANTS = ("none", "reference_gi", "reference_li")


# ---------------------------------------------------------------------- flat parameter views


def flatten(params: dict[str, torch.Tensor], lead: int) -> torch.Tensor:
    """The parameters as one [*lead_shape, P] matrix (``lead`` leading axes kept)."""
    first = next(iter(params.values()))
    return torch.cat([v.reshape(*first.shape[:lead], -1) for v in params.values()], -1)


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], lead: int) -> dict[str, torch.Tensor]:
    out, a = {}, 0
    for k, v in like.items():
        size = int(np.prod(v.shape[lead:], dtype=np.int64))
        out[k] = flat[..., a : a + size].reshape(*flat.shape[:-1], *v.shape[lead:])
        a += size
    return out


# ---------------------------------------------------------------------- gossip


def gossip(params: dict[str, torch.Tensor], sizes: np.ndarray, repeats: int, mode: str, weighting: str,
           rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], int]:
    """R repeats of symmetric pairwise exchange among the rows of ``params`` (the local models of
    one cluster's members, stacked); returns (the mixed models, the number of exchanges).

    Both partners of an exchange take the same value, (θ_i + θ_j)/2 (``uniform``) or
    (n_iθ_i + n_jθ_j)/(n_i + n_j) (``samples``, each then holding (n_i + n_j)/2), so the
    members' (weighted) mean never changes. ``random_pairs``: in each repeat every member, in
    order, averages with a peer drawn uniformly from the others. ``matching``: each repeat
    averages the disjoint pairs of a random perfect matching at once."""
    m = next(iter(params.values())).shape[0]
    if m < 2 or repeats == 0:
        return {k: v.clone() for k, v in params.items()}, 0
    flat = flatten(params, 1).clone()
    w = np.asarray(sizes, np.float64).copy() if weighting == "samples" else np.ones(m)
    exchanges = 0
    for _ in range(repeats):
        if mode == "matching":
            perm = rng.permutation(m)[: 2 * (m // 2)]
            a, b = perm[0::2], perm[1::2]
            share = torch.from_numpy(w[a] / (w[a] + w[b])).to(flat.dtype).to(flat.device).unsqueeze(1)
            ia, ib = torch.from_numpy(a).to(flat.device), torch.from_numpy(b).to(flat.device)
            mixed = flat[ia] * share + flat[ib] * (1 - share)
            flat[ia], flat[ib] = mixed, mixed
            w[a] = w[b] = (w[a] + w[b]) / 2
            exchanges += len(a)
        else:
            peers = (np.arange(m) + rng.integers(1, m, size=m)) % m
            for i, j in enumerate(peers):
                share = w[i] / (w[i] + w[j])
                mixed = flat[i] * share + flat[j] * (1 - share)
                flat[i], flat[j] = mixed, mixed
                w[i] = w[j] = (w[i] + w[j]) / 2
            exchanges += m
    return unflatten(flat, params, 1), exchanges


def reference_threshold(m: int) -> int:
    """h = min(m − 1, 50 if m > 800 else 15): partner counts are drawn from U{1, …, h−1}."""
    return min(m - 1, 50 if m > 800 else 15)


def reference_gossip(flat: torch.Tensor, clusters: np.ndarray, rng: np.random.Generator) -> int:
    """The reference code's exchange, in place on ``flat`` ([m, k, P]: every participant's k
    copies) for participants with clusters ``clusters``; returns the number of exchanges."""
    m = len(clusters)
    h = reference_threshold(m)
    if h <= 1:
        return 0
    counts = rng.integers(1, h, size=m)
    lists = [list(rng.choice(np.delete(np.arange(m), i), size=int(counts[i]), replace=False)) for i in range(m)]
    exchanges = 0
    for i in range(m):
        for j in list(lists[i]):
            ci, cj = int(clusters[i]), int(clusters[j])
            alpha = 0.5 if ci == cj else 0.4
            flat[i, cj] = alpha * flat[i, cj] + (1 - alpha) * flat[j, cj]
            flat[j, ci] = alpha * flat[j, ci] + (1 - alpha) * flat[i, ci]
            exchanges += 1
            # the exchange counts against j's own draw as well
            if i in lists[j]:
                lists[j].remove(i)
            elif lists[j]:
                lists[j].pop(int(rng.integers(len(lists[j]))))
            else:
                for other in lists:
                    if j in other:
                        other.remove(j)
    return exchanges


def copies_of(client_models: dict[str, torch.Tensor], clients: np.ndarray, which: np.ndarray) -> dict[str, torch.Tensor]:
    """Client ``clients[i]``'s own copy of model ``which[i]``, stacked (from [N, k, ...] copies)."""
    device = next(iter(client_models.values())).device
    idx = torch.from_numpy(np.asarray(clients, np.int64)).to(device)
    col = torch.from_numpy(np.asarray(which, np.int64)).to(device)
    return {k: v[idx, col] for k, v in client_models.items()}


def pick_tokens(assign: np.ndarray, k: int, seed: int, round: int) -> np.ndarray:
    """The cohort position of each cluster's token holder: one per non-empty cluster, uniform
    among its members (stream (seed, round, cluster, "difca/token")); −1 for a cluster nobody chose."""
    holder = np.full(k, -1, np.int64)
    for c in range(k):
        members = np.flatnonzero(assign == c)
        if len(members):
            holder[c] = members[np_rng(seed, round, c, "difca/token").integers(len(members))]
    return holder


# ---------------------------------------------------------------------- confidence


@torch.no_grad()
def client_confidences(model, models: dict[str, torch.Tensor], split, clients: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, C] mean max-softmax of every listed client's inputs under every model (labels
    unused), and the [C] sample counts."""
    offsets = split.offsets
    idx = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in clients] or [np.zeros(0, np.int64)])
    seg = np.repeat(np.arange(len(clients)), np.diff(offsets)[clients])
    x = split.x[torch.from_numpy(idx).to(split.x.device)]
    k = next(iter(models.values())).shape[0]
    if len(idx) == 0:
        return torch.zeros(k, len(clients)), torch.zeros(len(clients))
    conf = stacked_outputs(model, models, x).softmax(-1).amax(-1)
    mean, counts = segment_mean(conf, torch.from_numpy(seg).to(conf.device), len(clients))
    return mean.cpu(), counts.cpu()


def confidence_scores(model, models: dict[str, torch.Tensor], data, clients: np.ndarray) -> torch.Tensor:
    """[k, C] confidences on the clients' test inputs (their training inputs when they have none)."""
    conf, counts = client_confidences(model, models, data.test, clients)
    empty = (counts == 0).numpy()
    if empty.any():
        conf[:, torch.from_numpy(empty)] = client_confidences(model, models, data.train, clients[empty])[0]
    return conf


def assign_by_max_confidence(conf: torch.Tensor) -> np.ndarray:
    """ĵ = argmax_j confidence, ties → lowest index."""
    return np.argmax(conf.numpy(), axis=0).astype(np.int64)


# ---------------------------------------------------------------------- the algorithm


class DIFCA(IFCA):
    name = "difca"
    paper = ("Kirch, Decentralized Federated Learning: Enhancing IFCA for Efficient Clustered Model Training "
             "(seed 002, 2024), on IFCA (arXiv 2006.04088)")
    hyperparameters = (
        choice("weighting", "uniform", ("uniform",), "unused: DIFCA has no server mean (the gossip's weights are "
               "algorithm.gossip_weighting)", "p_i"),
        choice("option", "model", ("model",), "local update: IFCA option II (τ local steps, train.*); option I is not "
               "defined for DIFCA"),
        Hyper("shared", "none", "weight sharing: none (IFCA's shared trunk needs a mean over all participants, which "
              "DIFCA's per-cluster gossip does not form)", kind="choice", choices=("none",)),
        integer("partners", 10, "gossip repeats per round: exchanges with same-cluster peers (0: the token holder's "
                "own model is the representative)", "R", ge=0),
        choice("gossip", "random_pairs", ("random_pairs", "matching"), "who exchanges in a repeat: every member with a "
               "uniformly drawn same-cluster peer (random_pairs), or a random perfect matching (matching)"),
        choice("gossip_weighting", "uniform", ("uniform", "samples"), "exchange average: (θ_i+θ_j)/2 (uniform, the "
               "seed) or n-weighted (samples, n_i exchanged with θ_i)", "n_i"),
        choice("dfca_variant", "none", VARIANTS, "none: the seed's algorithm; reference_gi / reference_li: the reference "
               "code's (every client keeps all k models, random partner counts, any-cluster partners, α=0.5/0.4), "
               "with shared (gi) or per-client (li) initial models"),
        choice("inference", "loss", ("loss", "confidence"), "evaluation's model choice: argmin training loss (loss) or "
               "argmax mean max-softmax on the client's unlabelled test inputs (confidence)"),
        choice("participation", "fixed", ("fixed", "sampled"), "participants: a set M of train.clients_per_round "
               "clients fixed for the run (fixed, the seed) or a new cohort every round (sampled)", "M"),
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

    @property
    def keeps_copies(self) -> bool:
        return self.hp("dfca_variant") != "none"

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
    def local_init_models(self, ctx: RunContext) -> dict[str, torch.Tensor]:
        """LI: k models per client, each from its own stream; [N, k, ...]."""
        per_client = []
        for i in range(ctx.num_clients):
            models = []
            for j in range(self.num_models):
                g = torch_generator(ctx.seed, client=i, purpose=f"difca/li/{j}")
                if self.cfg.model.name == "linear":
                    models.append({n: torch.bernoulli(torch.full_like(p, 0.5), generator=g)
                                   for n, p in ctx.model.named_parameters()})
                else:
                    models.append(init_params(ctx.model, g))
            per_client.append(stack(models))
        return stack(per_client)

    def init_state(self, ctx: RunContext) -> ServerState:
        state = super().init_state(ctx)
        algo: dict[str, Any] = {"token_holder": torch.full((self.num_models,), -1, dtype=torch.int64),
                                "token_round": torch.tensor(-1)}
        if self.hp("participation") == "fixed":
            algo["participants"] = torch.from_numpy(self.participants(ctx))
        variant = self.hp("dfca_variant")
        if variant == "reference_gi":
            n = ctx.num_clients
            algo["client_models"] = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in state.models.items()}
        elif variant == "reference_li":
            device = next(iter(state.models.values())).device
            algo["client_models"] = {k: v.to(device) for k, v in self.local_init_models(ctx).items()}
        return state.replace(algo=algo)

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """IFCA's pre-federation initialisation (init=pretrain_kmeans); under reference_gi every
        client's copies then start from the k models it produced."""
        new = super().pre_federation(state, ctx)
        if self.hp("dfca_variant") == "reference_gi":
            n = ctx.num_clients
            cm = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in new.models.items()}
            new = new.replace(algo={**new.algo, "client_models": cm})
        return new

    # ------------------------------------------------------------------ model choice
    def own_losses(self, state: ServerState, ctx: RunContext, clients: np.ndarray) -> torch.Tensor:
        """[k, C] training loss of every listed client under each of its own k copies."""
        cm = state.algo["client_models"]
        cols = [client_model_losses(ctx.model, {k: v[int(c)] for k, v in cm.items()}, ctx.data.train,
                                    np.array([c]), ctx.data.task)[0] for c in clients]
        return torch.cat(cols, 1) if cols else torch.zeros(self.num_models, 0)

    def own_confidences(self, state: ServerState, ctx: RunContext, clients: np.ndarray) -> torch.Tensor:
        cm = state.algo["client_models"]
        cols = [confidence_scores(ctx.model, {k: v[int(c)] for k, v in cm.items()}, ctx.data, np.array([c]))
                for c in clients]
        return torch.cat(cols, 1) if cols else torch.zeros(self.num_models, 0)

    def choose(self, state: ServerState, ctx: RunContext, clients: np.ndarray, rule: str) -> np.ndarray:
        """The model each listed client uses: argmin loss or argmax confidence, over the
        representatives (seed) or over the client's own copies (reference variants)."""
        clients = np.asarray(clients, np.int64)
        if rule == "confidence":
            if ctx.data.task != "classification":
                raise ConfigError("algorithm.inference: confidence needs class probabilities; this data is a regression "
                                  "task (use inference=loss)")
            conf = (self.own_confidences(state, ctx, clients) if self.keeps_copies
                    else confidence_scores(ctx.model, state.models, ctx.data, clients))
            return assign_by_max_confidence(conf)
        losses = self.own_losses(state, ctx, clients) if self.keeps_copies else cluster_losses(state, ctx, clients)
        return assign_by_min_loss(losses)

    # ------------------------------------------------------------------ hooks
    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        if not self.keeps_copies:
            spec = super().local_spec(state, ctx, clients, round)
        else:
            losses = self.own_losses(state, ctx, clients)
            chosen = assign_by_min_loss(losses)
            t = self.cfg.train
            init = copies_of(state.algo["client_models"], clients, chosen)
            spec = LocalSpec(clients, init, t.lr, t.local_epochs, t.local_steps, t.batch_size, t.full_batch, meta={"model_of_client": chosen, "cluster_losses": losses},
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
        if self.keeps_copies:
            exchanges = self._reference_round(state, ctx, result, assign, holder, models, algo, round)
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
        new = self._with_assignments(state, models, clients, assign).replace(algo=algo)
        new.meta["difca_round"] = {"round": round, "bytes_p2p": int(p2p), "gossip_exchanges": int(exchanges),
                                   "participants": len(clients)}
        log_round(new, bytes_p2p=int(p2p), gossip_exchanges=int(exchanges))
        return new

    def _reference_round(self, state, ctx, result, assign, holder, models, algo, round) -> int:
        """The reference variants: trained copies go back into every client's k models, the
        reference gossip runs over all participants, representatives are the holders' copies."""
        cm = state.algo["client_models"]
        device = next(iter(cm.values())).device
        clients = np.asarray(result.clients, np.int64)
        idx = torch.from_numpy(clients).to(device)
        col = torch.from_numpy(np.asarray(assign, np.int64)).to(device)
        mine = {name: v[idx] for name, v in cm.items()}  # the participants' k copies
        flat = flatten(mine, 2)  # [m, k, P], a fresh tensor
        flat[torch.arange(len(clients), device=device), col] = flatten({n: result.params[n] for n in cm}, 1).to(flat)
        rng = np_rng(ctx.seed, round, purpose="difca/reference_partners")
        exchanges = reference_gossip(flat, np.asarray(assign, np.int64), rng)
        mixed = unflatten(flat, mine, 2)
        new_cm = {name: v.clone() for name, v in cm.items()}
        for name in new_cm:
            new_cm[name][idx] = mixed[name]
        for c in np.flatnonzero(holder >= 0):
            for name in models:
                models[name][c] = new_cm[name][int(holder[c]), int(c)]
        algo["client_models"] = new_cm
        return exchanges

    # ------------------------------------------------------------------ evaluation
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return self.choose(state, ctx, np.arange(ctx.num_clients), self.hp("inference"))

    def evaluate(self, state: ServerState, ctx: RunContext) -> dict[str, Any]:
        if not self.keeps_copies:
            return super().evaluate(state, ctx)
        return self.evaluate_own_copies(state, ctx)

    def evaluate_own_copies(self, state: ServerState, ctx: RunContext) -> dict[str, Any]:
        """Reference variants: each client's test metrics with its own copy of the model it
        chooses (the metric keys of :func:`evaluate_models`)."""
        assign = self.eval_assignment(state, ctx)
        clients = ctx.seen
        mine = assign[clients]
        own = copies_of(state.algo["client_models"], clients, mine)
        c_loss, c_acc, n = own_model_metrics(ctx.model, own, ctx.data.test, clients, ctx.data.task)
        out: dict[str, Any] = summarise_clients(c_loss, c_acc, n, ctx.data.task)
        out.update(cluster_breakdown(ctx, clients, mine, c_loss, c_acc, n, state.k))
        out["_client_accuracy"] = c_acc if ctx.data.task == "classification" else None
        out["_client_loss"] = c_loss
        out["_assignment"] = assign
        return out

    def finetune(self, state, ctx, clients, assign, round, engine, stream):
        """Reference variants fine-tune each client's own copy of its chosen model."""
        if not self.keeps_copies:
            return super().finetune(state, ctx, clients, assign, round, engine, stream)
        k = state.k
        flat = {name: v.reshape(-1, *v.shape[2:]) for name, v in state.algo["client_models"].items()}
        return super().finetune(state.replace(models=flat), ctx, clients, np.asarray(clients) * k + np.asarray(assign),
                                round, engine, stream)

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
        down = len(clients) * state.k * mb if state.round == 0 and self.hp("dfca_variant") != "reference_li" else 0
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
        down = (state.k * mb if state.round == 0 and self.hp("dfca_variant") != "reference_li" else 0) + p2p
        return ctx.system.round_time(clients, steps, down / 1e6, (mb + p2p) / 1e6)

