"""CFL — Sattler, Müller, Samek, "Clustered Federated Learning: Model-Agnostic Distributed
Multitask Optimization Under Privacy Constraints", IEEE TNNLS 32(8) 2021, arXiv 1910.01991
(official code felisat/clustered-federated-learning; spec ``personalised-baselines.md`` §2).

FedAvg runs inside each cluster c (one model θ_c per cluster; every client is in exactly one
cluster, all start in cluster 0). Every round the server forms each trained client's update

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

γ_max bounding the relative error ‖∇r_i − ∇R_k(i)‖ ≤ γ‖∇r_i‖. The code and the PACFL thesis
(ε₁ = 0.4, ε₂ = 1.6, also the code's) have no γ check: ``gamma_max=null`` (default) skips it.
The paper gives no per-experiment ε₁, ε₂, γ_max. c₁ keeps the index of c and c₂ takes the next
free one (one more model per split); both start from θ_c and take this round's FedAvg of their
own members (the code splits, then aggregates cluster-wise). Clusters never merge: the splits
form a binary tree.

Partial participation (the paper and the code train every client every round): a member of a
split cluster that did not train this round has no update to place it by; it stays in c₁ and is
counted (``cfl_unplaced``). Newcomers (``partition.unseen_fraction``) join the cluster whose
model has the lowest loss on their training data. Evaluation gives every client its cluster's
model (the thesis).

State: ``algo['cfl_parent']`` (each cluster's parent, −1 for the root), ``algo['cfl_born']``
(the round of the split that made it, −1 for the root) and ``meta['cfl_splits']``, one record
per split (round, parent, children, their sizes, ‖mean Δθ‖, max ‖Δθ_i‖, α_cross^max, the
smallest α inside either child, the γ bound). Each history row gets ``cfl_splits``,
``cfl_clusters``, ``cfl_mean_update_norm`` (the largest ‖mean Δθ‖ over the clusters that
trained: < ε₁ means all are stationary), ``cfl_max_update_norm`` (the largest ‖Δθ_i‖),
``cfl_refused`` (splits the γ check refused) and ``cfl_unplaced``.

``update_pool=stale_all`` (the registry's ``cfl-pacfl``: the PACFL thesis's CFL code,
MMorafah/PACFL ``main_cfl.py``) runs the norms, the similarities and the aggregation over *every*
member of a cluster, each with its latest Δθ_i: this round's if it trained, else the one it sent
when it last trained (kept per client in a :class:`~flockfl.clientstate.ClientTable`,
``state.algo['cfl_delta']``), zero if it never trained. The cluster model takes
θ_c ← θ_c + Σ_{i∈c} p_i Δθ_i every round, so a stale update is applied again each round until its
client trains again (the thesis's CFL ≈ FedAvg; the spec says not to "fix" it). BN statistics
(not compared, not in Δθ) take the participants' mean as in FedAvg. A split places every member,
trained or not, by its Δθ; the thesis code's 0-based ``iteration > 20`` is ``warmup_rounds=21``.

The notebook's persistent client optimisers (momentum across rounds) are
``train.optimizer_state=persist`` with ``train.momentum``. Not modelled: its model cache at splits
with best-cached-model evaluation.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from flockfl.aggregation import flatten, mean_weights, unflatten, weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.auto import confirmed, memory, recorded
from flockfl.algorithms.hyper import choice, integer, is_auto, real, sourced_each, weighting
from flockfl.clustering.choose import choose_cut
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.clientstate import ClientTable
from flockfl.clustering.bipartition import bipartition, cosine_similarities, cross_max, gamma_bound, intra_min
from flockfl.engine.functional import index_params
from flockfl.engine.trainers import stat_names
from flockfl.state import ServerState, log_round


class CFL(Algorithm):
    name = "cfl"
    family = "clustered"
    paper = ("Sattler, Müller, Samek, Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization "
             "under Privacy Constraints, IEEE TNNLS 2021, arXiv 1910.01991")
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

    # ------------------------------------------------------------------ state
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

    # ------------------------------------------------------------------ hooks
    def model_of(self, state, ctx, clients):
        return state.assignments[clients]

    def eval_assignment(self, state, ctx):
        return state.assignments

    def aggregate(self, state: ServerState, ctx, spec, result, assign) -> ServerState:
        """Test every cluster (a)–(c), split those that pass (and the γ check), then FedAvg
        inside every cluster, the new ones included (with ``stale_all``: over every member)."""
        a = self.cfg.algorithm
        names = self.trainable(ctx)
        start = index_params({k: state.models[k] for k in names}, torch.from_numpy(assign))
        fresh = flatten(result.params, names) - flatten(start, names)
        stale = a.update_pool == "stale_all"
        if stale:  # the pool is every federating client, each with its latest Δθ (zero if it never trained)
            table = state.algo["cfl_delta"].scatter(result.clients, {"d": fresh.float().cpu()})
            pool = ctx.seen
            current = state.assignments.copy()
            current[result.clients] = assign
            pool_assign, delta = current[pool], table.gather(pool)["d"].double()
            sizes = ctx.data.train.sizes[pool]
            weights_of = lambda members: mean_weights(sizes[members], a.weighting)  # noqa: E731
        else:
            pool, pool_assign, delta = result.clients, assign, fresh.double().cpu()
            weights_of = lambda members: self.weights(result, members)  # noqa: E731
        norms = torch.linalg.vector_norm(delta, dim=1).numpy()
        parent, born = state.algo["cfl_parent"].tolist(), state.algo["cfl_born"].tolist()
        new_assign, records = pool_assign.copy(), []
        worst, refused, unplaced = 0.0, 0, 0
        auto_split, decisions = is_auto(a.eps1), []
        last, now = dict(state.meta.get("cfl_auto_last", {})), {}
        found = dict(state.meta.get("cfl_auto_groups", {}))  # cluster → the groups a confirmed test saw in it
        for c in range(state.k):
            members = np.flatnonzero(pool_assign == c)
            if len(members) == 0:
                continue
            mean = weighted_mean({"d": delta[members]}, weights_of(members))["d"]
            mean_norm, max_norm = float(torch.linalg.vector_norm(mean)), float(norms[members].max())
            worst = max(worst, mean_norm)
            if not (len(members) >= a.min_split_size and state.round + 1 > a.warmup_rounds
                    and (auto_split or (mean_norm < a.eps1 and max_norm > a.eps2))):
                continue
            sim = cosine_similarities(delta[members].numpy())
            if auto_split:  # split iff the same structure shows in two consecutive tests (see auto_split_test)
                choice, stable = auto_split_test(sim, a.linkage, pool[members], last.get(str(c)), state.round,
                                                 found.get(str(c)) == 1)
                decisions.append((choice, c, len(members), stable))
                now[str(c)] = memory(choice, pool[members], state.round)
                if choice.k < 2 or not stable:
                    continue
            labels = bipartition(sim, a.linkage)
            cross = cross_max(sim, labels)
            if a.gamma_max is not None and not a.gamma_max < gamma_bound(cross):
                refused += 1
                continue
            child = len(parent)
            parent.append(c)
            born.append(state.round)
            new_assign[members[labels == 1]] = child
            if auto_split:  # how many of the test's groups each half holds (1: a group found; see auto_split_test)
                found[str(c)] = len(np.unique(choice.labels[labels == 0]))
                found[str(child)] = len(np.unique(choice.labels[labels == 1]))
            absent = [] if stale else np.setdiff1d(ctx.seen[state.assignments[ctx.seen] == c], result.clients)
            unplaced += len(absent)
            records.append({"round": int(state.round), "parent": c, "children": [c, child],
                            "sizes": [int((labels == 0).sum() + len(absent)), int((labels == 1).sum())],
                            "mean_update_norm": mean_norm, "max_update_norm": max_norm, "alpha_cross_max": cross,
                            "alpha_intra_min": intra_min(sim, labels), "gamma_bound": gamma_bound(cross)})
        grown = state
        if records:  # each new cluster starts from its parent's model
            src = torch.tensor(parent[state.k:], dtype=torch.int64)
            grown = state.replace(models={k: torch.cat([v, v[src.to(v.device)]]) for k, v in state.models.items()})
        algo = {**state.algo, "cfl_parent": torch.tensor(parent, dtype=torch.int64),
                "cfl_born": torch.tensor(born, dtype=torch.int64)}
        if stale:
            trained = new_assign[np.searchsorted(pool, result.clients)]
            new = super().aggregate(grown, ctx, spec, result, trained)  # BN statistics: the participants' mean
            models = dict(new.models)
            for j in range(new.k):  # θ_j ← θ_j + Σ p_i Δθ_i over every member, stale updates included
                members = np.flatnonzero(new_assign == j)
                if len(members) == 0:
                    continue
                step = weighted_mean({"d": delta[members]}, weights_of(members))["d"]
                base = {n: grown.models[n][j] for n in names}
                moved = unflatten(flatten(base, names, lead=0) + step.to(flatten(base, names, lead=0)), base, lead=0)
                for n in names:
                    models[n] = models[n].clone() if models[n] is new.models[n] else models[n]
                    models[n][j] = moved[n]
            assignments = new.assignments.copy()
            assignments[pool] = new_assign
            new = new.replace(models=models, assignments=assignments)
            algo["cfl_delta"] = table
        else:
            new = super().aggregate(grown, ctx, spec, result, new_assign)
        new = new.replace(algo=algo, meta={**state.meta, "cfl_splits": list(state.meta.get("cfl_splits", [])) + records})
        for choice, c, size, stable in decisions:  # the evidence of each auto split test
            new = recorded(new, choice, "algorithm.eps1", self.name, state.round, log=False, cluster=c, members=size,
                           confirmed=bool(stable and choice.k > 1))
        if auto_split:
            new = new.replace(meta={**new.meta, "cfl_auto_last": now, "cfl_auto_groups": found})
            log_round(new, auto_tests=len(decisions), auto_splits=sum(st and ch.k > 1 for ch, _, _, st in decisions))
        log_round(new, cfl_splits=len(records), cfl_clusters=new.k, cfl_mean_update_norm=worst,
                  cfl_max_update_norm=float(norms.max()), cfl_refused=refused, cfl_unplaced=unplaced)
        return new

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer joins the cluster whose model has the lowest loss on its training data."""
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "the lowest-loss cluster model"


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
    from flockfl.clustering.choose import NESTED

    choice = choose_cut(1.0 - sim, linkage)
    if one_group and choice.k > 1 and not choice.score > NESTED:
        choice.reason += f"; this cluster is one group already found: a split needs > {NESTED}"
        return choice, False
    return choice, confirmed(choice, clients, last, round)


# where cfl-pacfl's defaults come from: the thesis's text, or its code (MMorafah/PACFL, which copies felisat's
# helpers)
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
