"""CFL — Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask
Optimization Under Privacy Constraints", IEEE TNNLS 32(8) 2021, arXiv 1910.01991 (official code
felisat/clustered-federated-learning; spec ``personalised-baselines.md`` §2).

FedAvg runs inside each cluster c (one model θ_c per cluster; every client is in exactly one cluster, all
start in cluster 0). Every round the server forms each trained client's update

    Δθ_i = SGD_n(θ_c(i), D_i) − θ_c(i)      (flattened trainable parameters, no BN statistics)

and tests every cluster c with at least ``min_split_size`` trained members (the code: len > 2):

    (a) stationarity   ‖Σ_{i∈c} p_i Δθ_i‖ < ε₁   (the norm of the *mean update*; p_i by ``weighting``:
                                                 uniform as the code, |D_i|/|D_c| as the paper)
    (b) divergence     max_{i∈c} ‖Δθ_i‖ > ε₂
    (c) warm-up        the 1-based round > ``warmup_rounds`` (the code's ``c_round > 20``)

When all hold, c is split by the cosine similarities α_ij = <Δθ_i,Δθ_j>/(‖Δθ_i‖‖Δθ_j‖ + 1e-12)
into (c₁, c₂) = argmin_{c₁∪c₂=c} max_{i∈c₁, j∈c₂} α_ij: the paper's Alg. 1 (single linkage,
exact) with ``linkage=single``; the code's complete linkage on −α with ``linkage=complete``
(default). The paper accepts the split only if

    γ_max < sqrt((1 − α_cross^max) / 2),    α_cross^max = max_{i∈c₁, j∈c₂} α_ij,

γ_max bounding the relative error ‖∇r_i − ∇R_k(i)‖ ≤ γ‖∇r_i‖. The code and the PACFL thesis (ε₁ = 0.4,
ε₂ = 1.6, also the code's) have no γ check: ``gamma_max=null`` (default) skips it. The paper gives no
per-experiment ε₁, ε₂, γ_max. c₁ keeps the index of c and c₂ takes the next free one (one more model per
split); both start from θ_c and take this round's FedAvg of their own members (the code splits, then
aggregates cluster-wise). Clusters never merge: the splits form a binary tree.

Partial participation (the paper and the code train every client every round): a member of a split cluster
that did not train this round has no update to place it by; it stays in c₁ and is counted (``cfl_unplaced``).
Newcomers (``partition.unseen_fraction``) join the cluster whose model has the lowest loss on their training
data. Evaluation gives every client its cluster's model (the thesis).

State: ``algo['cfl_parent']`` (each cluster's parent, −1 for the root), ``algo['cfl_born']`` (the round of
the split that made it, −1 for the root) and ``meta['cfl_splits']``, one record per split (round, parent,
children, their sizes, ‖mean Δθ‖, max ‖Δθ_i‖, α_cross^max, the smallest α inside either child, the γ bound).
Each history row gets ``cfl_splits``, ``cfl_clusters``, ``cfl_mean_update_norm`` (the largest ‖mean Δθ‖
over the clusters that trained: < ε₁ means all are stationary), ``cfl_max_update_norm`` (the largest
‖Δθ_i‖), ``cfl_refused`` (splits the γ check refused) and ``cfl_unplaced``.

``update_pool=stale_all`` (the registry's ``cfl-pacfl``: the PACFL thesis's CFL code, MMorafah/PACFL
``main_cfl.py``) runs the norms, the similarities and the aggregation over *every* member of a cluster, each
with its latest Δθ_i: this round's if it trained, else the one it sent when it last trained (kept per client
in a :class:`~flockfl.clientstate.ClientTable`, ``state.algo['cfl_delta']``), zero if it never trained. The
cluster model takes θ_c ← θ_c + Σ_{i∈c} p_i Δθ_i every round, so a stale update is applied again each round
until its client trains again (the thesis's CFL ≈ FedAvg; the spec says not to "fix" it). BN statistics (not
compared, not in Δθ) take the participants' mean as in FedAvg. A split places every member, trained or not, by
its Δθ; the thesis code's 0-based ``iteration > 20`` is ``warmup_rounds=21``.

The notebook's persistent client optimisers (momentum across rounds) are ``train.optimizer_state=persist``
with ``train.momentum``. Not modelled: its model cache at splits with best-cached-model evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np
import torch

from flockfl.aggregation import flatten, mean_weights, unflatten, weighted_mean
from flockfl.algorithms.auto import confirmed, memory, recorded
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, integer, is_auto, real, sourced_each, weighting
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.clientstate import ClientTable
from flockfl.clustering.bipartition import bipartition, cosine_similarities, cross_max, gamma_bound, intra_min
from flockfl.clustering.choose import NESTED, choose_cut
from flockfl.engine.functional import index_params
from flockfl.engine.trainers import stat_names
from flockfl.state import ServerState, log_round


class CFL(Algorithm):
    """Each client trains its cluster's model; the server splits the clusters that pass the tests, then runs
    FedAvg inside every cluster. The split is in ``aggregate``, not the ``cluster`` hook: it must see the updates
    as sent, after the stages' ``before_aggregate`` (the pruning stage's fill, which indexes models by cluster)."""

    name = "cfl"
    family = "clustered"
    paper = ("Sattler, Müller, Samek, Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization "
             "under Privacy Constraints, IEEE TNNLS 2021, arXiv 1910.01991")

    def model_of(self, state, ctx, clients):
        return state.assignments[clients]  # θ_c(i), the model of the client's cluster

    def aggregate(self, state: ServerState, ctx, spec, result, assign) -> ServerState:
        """Δθ_i of the pool, every cluster tested (a)–(c) and split where it passes (and the γ
        check), then FedAvg inside every cluster, the new ones included."""
        a, names = self.cfg.algorithm, self.trainable(ctx)
        pool = (stale_all if a.update_pool == "stale_all" else participants)(self, names, state, ctx, result, assign)
        test = AutoTest(state, a.linkage) if is_auto(a.eps1) else NormTest(a.eps1, a.eps2)
        tree = split_clusters(state, pool, test, a)
        grown = tree.grow(state)  # each new cluster starts from its parent's model
        new = super().aggregate(grown, ctx, spec, result, tree.assign[pool.rows])  # the participants' FedAvg
        if pool.table is not None:  # stale_all: the trainable parameters take every member's latest Δθ_i
            new = stale_step(new, grown, pool, tree.assign, names)
        return finish(new, state, pool, tree, test, self.name)

    def eval_assignment(self, state, ctx):
        return state.assignments

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer joins the cluster whose model has the lowest loss on its training data."""
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "the lowest-loss cluster model"

    hyperparameters = (
        replace(weighting("uniform", source="code", note="felisat/clustered-federated-learning: every member's copy "
                                                         "gets the unweighted mean of the cluster's Δθ_i"),
                meaning="weights of the updates in a cluster's mean (its FedAvg and the ε₁ test): uniform (the code) "
                        "or samples n_i (the paper)"),
        real("eps1", 0.4, "stationarity: a cluster may split only while the norm of its mean update is below ε₁ "
             "(the code and the PACFL thesis); auto (with eps2=auto): instead of the two norms, a cluster splits when the "
             "silhouette criterion on 1 − α finds the same structure two rounds running ('CFL + auto split' in tables)", "ε₁", gt=0, auto=True,
             source="code",
             note="felisat/clustered-federated-learning: EPS_1 = 0.4 (the paper's value: not found)"),
        real("eps2", 1.6, "divergence: ... and its largest client update norm exceeds ε₂ (the code and the PACFL "
             "thesis); auto: see eps1", "ε₂", ge=0, auto=True, source="code",
             note="felisat/clustered-federated-learning: EPS_2 = 1.6 (the paper's value: not found)"),
        real("gamma_max", None, "accept a split only if γ_max < sqrt((1 − α_cross^max)/2) (the paper's criterion; "
             "null: no check, as the code and the thesis)", "γ_max", ge=0, lt=1, optional=True, source="code",
             note="felisat/clustered-federated-learning has no γ check (the paper's γ_max: not found)"),
        choice("linkage", "complete", ("complete", "single"), "bi-partition of the update similarities: complete "
               "linkage on −α (the code) or single linkage, the exact argmin of the max cross similarity (the paper's "
               "Alg. 1)", source="code",
               note="felisat/clustered-federated-learning: AgglomerativeClustering(linkage=\"complete\") on −S"),
        integer("warmup_rounds", 20, "no split until the 1-based round exceeds this (the code's c_round > 20)", ge=0,
                source="code", note="felisat/clustered-federated-learning: c_round > 20, 1-based (first split in "
                                    "round 21); not in the paper"),
        integer("min_split_size", 3, "a cluster is tested only with at least this many trained members (the code: "
                "more than 2)", ge=2, source="code",
                note="felisat/clustered-federated-learning: len(cluster) > 2; not in the paper"),
        choice("update_pool", "participants", ("participants", "stale_all"), "whose updates the tests and the mean "
               "use: this round's participants (the code, the paper) or every member with its latest, possibly stale, "
               "update (the PACFL thesis's code: cfl-pacfl)", source="code",
               note="felisat/clustered-federated-learning (and the paper's Alg. 2): this round's Δθ_i, every client "
                    "participating; under partial participation the participants only, as KarhouTam/FL-bench cfl.py"),
    )

    @classmethod
    def check_config(cls, cfg):
        a = cfg.algorithm
        if is_auto(a.eps1) != is_auto(a.eps2):
            raise ValueError(f"algorithm.eps1/eps2: auto replaces both norm tests by one silhouette test, so set both to "
                             f"auto or neither (given eps1={a.eps1}, eps2={a.eps2})")

    def init_state(self, ctx):
        state = super().init_state(ctx)
        root = torch.tensor([-1], dtype=torch.int64)
        algo = {"cfl_parent": root, "cfl_born": root.clone()}
        if self.hp("update_pool") == "stale_all":
            size = sum(state.models[n][0].numel() for n in self.trainable(ctx))
            algo["cfl_delta"] = ClientTable(ctx.num_clients, {"d": torch.zeros(size)})
        return state.replace(algo=algo, meta={**state.meta, "cfl_splits": []})

    def trainable(self, ctx) -> list[str]:
        """The parameters whose updates CFL compares (not the BN statistics)."""
        frozen = set(stat_names(ctx.model))
        return [n for n, _ in ctx.model.named_parameters() if n not in frozen]


@dataclass(frozen=True)
class Updates:
    """The pool's clients, their clusters before the split, their Δθ_i (float64, CPU) and p_i."""

    clients: np.ndarray
    assign: np.ndarray
    delta: torch.Tensor
    weights: Callable[[np.ndarray], torch.Tensor]
    rows: np.ndarray  # where this round's trained clients are in the pool
    idle: np.ndarray  # the cluster of each federating client without an update (it stays in c₁ at a split)
    table: Optional[ClientTable] = None  # stale_all: every client's latest Δθ_i


def fresh_updates(names: list[str], state: ServerState, result, assign: np.ndarray) -> torch.Tensor:
    """Δθ_i = SGD_n(θ_c(i), D_i) − θ_c(i), one row per trained client."""
    start = index_params({k: state.models[k] for k in names}, torch.from_numpy(assign))
    return flatten(result.params, names) - flatten(start, names)


def participants(alg: CFL, names, state, ctx, result, assign) -> Updates:
    """This round's participants (the paper, the code)."""
    idle = state.assignments[np.setdiff1d(ctx.seen, result.clients)]
    return Updates(result.clients, assign, fresh_updates(names, state, result, assign).double().cpu(),
                   lambda members: alg.weights(result, members), np.arange(len(result.clients)), idle)


def stale_all(alg: CFL, names, state, ctx, result, assign) -> Updates:
    """Every federating client with its latest, possibly stale, Δθ_i (cfl-pacfl)."""
    fresh = fresh_updates(names, state, result, assign).float().cpu()
    table = state.algo["cfl_delta"].scatter(result.clients, {"d": fresh})
    pool, sizes, current = ctx.seen, ctx.data.train.sizes[ctx.seen], state.assignments.copy()
    current[result.clients] = assign
    return Updates(pool, current[pool], table.gather(pool)["d"].double(),
                   lambda members: mean_weights(sizes[members], alg.weighting), np.searchsorted(pool, result.clients),
                   np.zeros(0, np.int64), table)


def mean_update(pool: Updates, members: np.ndarray) -> torch.Tensor:
    return weighted_mean({"d": pool.delta[members]}, pool.weights(members))["d"]  # Σ_{i∈c} p_i Δθ_i


@dataclass
class Split:
    """A round's splits: the pool's clusters after them, the tree, the records and the round's counts."""

    assign: np.ndarray
    parent: list[int]
    born: list[int]
    max_norm: float  # the largest ‖Δθ_i‖ in the pool
    records: list[dict] = field(default_factory=list)
    worst: float = 0.0  # the largest ‖mean Δθ‖
    refused: int = 0
    unplaced: int = 0

    def grow(self, state: ServerState) -> ServerState:
        """The state with one more model per split, a copy of its parent's."""
        if not self.records:
            return state
        src = torch.tensor(self.parent[state.k:], dtype=torch.int64)
        return state.replace(models={k: torch.cat([v, v[src.to(v.device)]]) for k, v in state.models.items()})


class NormTest:
    """(a) stationarity and (b) divergence (the paper, the code); the auto test's other hooks do nothing."""

    def __init__(self, eps1: float, eps2: float):
        self.eps1, self.eps2 = eps1, eps2

    def should_split(self, mean_norm: float, max_norm: float) -> bool:
        return mean_norm < self.eps1 and max_norm > self.eps2

    def confirms(self, sim: np.ndarray, c: int, clients: np.ndarray) -> bool:
        return True

    def split(self, c: int, child: int, labels: np.ndarray) -> None:
        pass

    def record(self, state: ServerState, name: str, round: int) -> ServerState:
        return state


def split_clusters(state: ServerState, pool: Updates, test, a) -> Split:
    """Every cluster with updates, split where (c), the size and ``test`` allow."""
    norms = torch.linalg.vector_norm(pool.delta, dim=1).numpy()
    tree = Split(pool.assign.copy(), state.algo["cfl_parent"].tolist(), state.algo["cfl_born"].tolist(),
                 float(norms.max()))
    for c in range(state.k):
        members = np.flatnonzero(pool.assign == c)
        if len(members) == 0:
            continue
        mean_norm, max_norm = float(torch.linalg.vector_norm(mean_update(pool, members))), float(norms[members].max())
        tree.worst = max(tree.worst, mean_norm)
        if (len(members) >= a.min_split_size and state.round + 1 > a.warmup_rounds
                and test.should_split(mean_norm, max_norm)):
            split_cluster(tree, state.round, c, members, pool, test, a, mean_norm, max_norm)
    return tree


def split_cluster(tree: Split, round: int, c: int, members: np.ndarray, pool: Updates, test, a, mean_norm: float,
                  max_norm: float) -> None:
    """c bi-partitioned by its members' α_ij, unless the auto test or the γ check says no."""
    sim = cosine_similarities(pool.delta[members].numpy())
    if not test.confirms(sim, c, pool.clients[members]):
        return
    labels = bipartition(sim, a.linkage)
    cross = cross_max(sim, labels)
    if a.gamma_max is not None and not a.gamma_max < gamma_bound(cross):
        tree.refused += 1
        return
    child = len(tree.parent)
    tree.parent.append(c)
    tree.born.append(round)
    tree.assign[members[labels == 1]] = child
    test.split(c, child, labels)
    absent = int(np.sum(pool.idle == c))
    tree.unplaced += absent
    tree.records.append({"round": int(round), "parent": c, "children": [c, child],
                         "sizes": [int((labels == 0).sum() + absent), int((labels == 1).sum())],
                         "mean_update_norm": mean_norm, "max_update_norm": max_norm, "alpha_cross_max": cross,
                         "alpha_intra_min": intra_min(sim, labels), "gamma_bound": gamma_bound(cross)})


def stale_step(new: ServerState, grown: ServerState, pool: Updates, assign: np.ndarray, names: list) -> ServerState:
    """θ_j ← θ_j + Σ_{i∈j} p_i Δθ_i over every member of j; every member moves to its cluster after the split."""
    models = dict(new.models)
    for j in range(new.k):
        members = np.flatnonzero(assign == j)
        if len(members) == 0:
            continue
        step = mean_update(pool, members)
        base = {n: grown.models[n][j] for n in names}
        moved = unflatten(flatten(base, names, lead=0) + step.to(flatten(base, names, lead=0)), base, lead=0)
        for n in names:
            models[n] = models[n].clone() if models[n] is new.models[n] else models[n]
            models[n][j] = moved[n]
    assignments = new.assignments.copy()
    assignments[pool.clients] = assign
    return new.replace(models=models, assignments=assignments)


def finish(new: ServerState, state: ServerState, pool: Updates, tree: Split, test, name: str) -> ServerState:
    """The tree, the stale updates, the split records and the round's counts kept."""
    algo = {**state.algo, "cfl_parent": torch.tensor(tree.parent, dtype=torch.int64),
            "cfl_born": torch.tensor(tree.born, dtype=torch.int64)}
    if pool.table is not None:
        algo["cfl_delta"] = pool.table
    splits = list(state.meta.get("cfl_splits", [])) + tree.records
    new = new.replace(algo=algo, meta={**state.meta, "cfl_splits": splits})
    new = test.record(new, name, state.round)
    log_round(new, cfl_splits=len(tree.records), cfl_clusters=new.k, cfl_mean_update_norm=tree.worst,
              cfl_max_update_norm=tree.max_norm, cfl_refused=tree.refused, cfl_unplaced=tree.unplaced)
    return new


class AutoTest:
    """(a) and (b) replaced by :func:`auto_split_test`, confirmed by the round before; one round's
    tests, what each saw (``cfl_auto_last``) and the groups each half of a split holds (``cfl_auto_groups``)."""

    def __init__(self, state: ServerState, linkage: str):
        self.round, self.linkage = state.round, linkage
        self.last = dict(state.meta.get("cfl_auto_last", {}))
        self.found = dict(state.meta.get("cfl_auto_groups", {}))  # cluster → the groups a confirmed test saw in it
        self.now, self.decisions = {}, []  # decisions: (choice, cluster, members, confirmed by the round before)

    def should_split(self, mean_norm: float, max_norm: float) -> bool:
        return True

    def confirms(self, sim: np.ndarray, c: int, clients: np.ndarray) -> bool:
        choice, stable = auto_split_test(sim, self.linkage, clients, self.last.get(str(c)), self.round,
                                         self.found.get(str(c)) == 1)
        self.decisions.append((choice, c, len(clients), stable))
        self.now[str(c)] = memory(choice, clients, self.round)
        return not (choice.k < 2 or not stable)

    def split(self, c: int, child: int, labels: np.ndarray) -> None:
        choice = self.decisions[-1][0]  # c's test, just confirmed; 1 group in a half: a group found
        self.found[str(c)] = len(np.unique(choice.labels[labels == 0]))
        self.found[str(child)] = len(np.unique(choice.labels[labels == 1]))

    def record(self, state: ServerState, name: str, round: int) -> ServerState:
        for choice, c, size, stable in self.decisions:  # the evidence of each test
            state = recorded(state, choice, "algorithm.eps1", name, round, log=False, cluster=c, members=size,
                             confirmed=bool(stable and choice.k > 1))
        state = state.replace(meta={**state.meta, "cfl_auto_last": self.now, "cfl_auto_groups": self.found})
        log_round(state, auto_tests=len(self.decisions),
                  auto_splits=sum(st and ch.k > 1 for ch, _, _, st in self.decisions))
        return state


def auto_split_test(sim: np.ndarray, linkage: str, clients: np.ndarray, last: dict | None, round: int,
                    one_group: bool = False):
    """``eps1=auto``: does this cluster hold structure? The criterion of every ``auto`` key
    (:func:`flockfl.clustering.choose.choose_cut` on 1 − α with CFL's linkage: the best mean
    silhouette over the cuts, the one-cluster floor, nested groups) must find k ≥ 2 in this
    round's test *and* in the cluster's test of the round before, with the same partition of the
    clients both saw (ARI 1): one round of SGD updates is a noisy sample, a true structure shows
    every round. CFL splits recursively, so a cluster may be one group an earlier confirmed test
    already found (``one_group``: the test that split its parent saw one group in it); as
    everywhere (:data:`~flockfl.clustering.choose.NESTED`), such a group is split again only on
    reasonable structure, a mean silhouette above 0.5 (inside one label-swapped group of eight
    digits clients, two clients with their own quirks score 0.25–0.27 round after round).
    Returns (the choice, whether it is confirmed)."""
    choice = choose_cut(1.0 - sim, linkage)
    if one_group and choice.k > 1 and not choice.score > NESTED:
        choice.reason += f"; this cluster is one group already found: a split needs > {NESTED}"
        return choice, False
    return choice, confirmed(choice, clients, last, round)


# where cfl-pacfl's defaults come from: the thesis's text, or its code (MMorafah/PACFL, which copies felisat's helpers)
THESIS_RUN = {
    "weighting": ("code", "MMorafah/PACFL main_cfl.py: felisat's unweighted mean of the cluster's Δθ_i"),
    "eps1": ("thesis", "the thesis's CFL: ε₁ = 0.4 (hard-coded in MMorafah/PACFL main_cfl.py)"),
    "eps2": ("thesis", "the thesis's CFL: ε₂ = 1.6 (hard-coded in MMorafah/PACFL main_cfl.py)"),
    "gamma_max": ("thesis", "the thesis's CFL has no γ check"),
    "linkage": ("code", "MMorafah/PACFL main_cfl.py: felisat's complete linkage on −S"),
    "warmup_rounds": ("code", "MMorafah/PACFL main_cfl.py: iteration > 20, 0-based (first split in round 22)"),
    "min_split_size": ("code", "MMorafah/PACFL main_cfl.py: len(cluster) > 2"),
    "update_pool": ("code", "MMorafah/PACFL main_cfl.py, client_cfl.py: every member's latest Δθ_i, stale if "
                            "not sampled, zero if never"),
}


class CFLPACFL(CFL):
    """CFL as the PACFL thesis ran it (its tables' CFL row): every member's latest update."""

    name = "cfl-pacfl"
    paper = ("Sattler, Müller, Samek (CFL), as run by the PACFL thesis's code (MMorafah/PACFL main_cfl.py): stale "
             "updates of unsampled members, first split in round 22")
    hyperparameters = sourced_each(tuple(
        replace(h, default="stale_all") if h.name == "update_pool"
        else replace(h, default=21, meaning="no split until the 1-based round exceeds this (the thesis code's 0-based "
                     "iteration > 20: the first split is in round 22)") if h.name == "warmup_rounds" else h
        for h in CFL.hyperparameters), THESIS_RUN)
