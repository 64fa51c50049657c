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

Not modelled: the notebook's persistent client optimisers (momentum across rounds), its model
cache at splits with best-cached-model evaluation, and the thesis code's stale updates of
unsampled members (the spec's ``cfl-pacfl``, ``update_pool=stale_all``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from flockfl.aggregation import flatten, weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.clustering.bipartition import bipartition, cosine_similarities, cross_max, gamma_bound, intra_min
from flockfl.engine.functional import index_params
from flockfl.engine.trainers import stat_names
from flockfl.state import ServerState, log_round


class CFL(Algorithm):
    name = "cfl"
    paper = ("Sattler, Müller, Samek, Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization "
             "under Privacy Constraints, IEEE TNNLS 2021, arXiv 1910.01991")
    hyperparameters = (
        replace(weighting("uniform"), meaning="weights of the updates in a cluster's mean (its FedAvg and the ε₁ "
                "test): uniform (the code) or samples n_i (the paper)"),
        real("eps1", 0.4, "stationarity: a cluster may split only while the norm of its mean update is below ε₁ "
             "(the code and the PACFL thesis)", "ε₁", gt=0),
        real("eps2", 1.6, "divergence: ... and its largest client update norm exceeds ε₂ (the code and the PACFL "
             "thesis)", "ε₂", ge=0),
        real("gamma_max", None, "accept a split only if γ_max < sqrt((1 − α_cross^max)/2) (the paper's criterion; "
             "null: no check, as the code and the thesis)", "γ_max", ge=0, lt=1, optional=True),
        choice("linkage", "complete", ("complete", "single"), "bi-partition of the update similarities: complete "
               "linkage on −α (the code) or single linkage, the exact argmin of the max cross similarity (the paper's "
               "Alg. 1)"),
        integer("warmup_rounds", 20, "no split until the 1-based round exceeds this (the code's c_round > 20)", ge=0),
        integer("min_split_size", 3, "a cluster is tested only with at least this many trained members (the code: "
                "more than 2)", ge=2),
    )

    # ------------------------------------------------------------------ state
    def init_state(self, ctx):
        state = super().init_state(ctx)
        root = torch.tensor([-1], dtype=torch.int64)
        return state.replace(algo={"cfl_parent": root, "cfl_born": root.clone()}, meta={**state.meta, "cfl_splits": []})

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
        inside every cluster, the new ones included."""
        a = self.cfg.algorithm
        names = self.trainable(ctx)
        start = index_params({k: state.models[k] for k in names}, torch.from_numpy(assign))
        delta = (flatten(result.params, names) - flatten(start, names)).double().cpu()
        norms = torch.linalg.vector_norm(delta, dim=1).numpy()
        parent, born = state.algo["cfl_parent"].tolist(), state.algo["cfl_born"].tolist()
        new_assign, records = assign.copy(), []
        worst, refused, unplaced = 0.0, 0, 0
        for c in range(state.k):
            members = np.flatnonzero(assign == c)
            if len(members) == 0:
                continue
            mean = weighted_mean({"d": delta[members]}, self.weights(result, members))["d"]
            mean_norm, max_norm = float(torch.linalg.vector_norm(mean)), float(norms[members].max())
            worst = max(worst, mean_norm)
            if not (len(members) >= a.min_split_size and state.round + 1 > a.warmup_rounds
                    and mean_norm < a.eps1 and max_norm > a.eps2):
                continue
            sim = cosine_similarities(delta[members].numpy())
            labels = bipartition(sim, a.linkage)
            cross = cross_max(sim, labels)
            if a.gamma_max is not None and not a.gamma_max < gamma_bound(cross):
                refused += 1
                continue
            child = len(parent)
            parent.append(c)
            born.append(state.round)
            new_assign[members[labels == 1]] = child
            absent = np.setdiff1d(ctx.seen[state.assignments[ctx.seen] == c], result.clients)
            unplaced += len(absent)
            records.append({"round": int(state.round), "parent": c, "children": [c, child],
                            "sizes": [int((labels == 0).sum() + len(absent)), int((labels == 1).sum())],
                            "mean_update_norm": mean_norm, "max_update_norm": max_norm, "alpha_cross_max": cross,
                            "alpha_intra_min": intra_min(sim, labels), "gamma_bound": gamma_bound(cross)})
        grown = state
        if records:  # each new cluster starts from its parent's model
            src = torch.tensor(parent[state.k:], dtype=torch.int64)
            grown = state.replace(models={k: torch.cat([v, v[src.to(v.device)]]) for k, v in state.models.items()})
        new = super().aggregate(grown, ctx, spec, result, new_assign)
        new = new.replace(algo={**state.algo, "cfl_parent": torch.tensor(parent, dtype=torch.int64),
                                "cfl_born": torch.tensor(born, dtype=torch.int64)},
                          meta={**state.meta, "cfl_splits": list(state.meta.get("cfl_splits", [])) + records})
        log_round(new, cfl_splits=len(records), cfl_clusters=new.k, cfl_mean_update_norm=worst,
                  cfl_max_update_norm=float(norms.max()), cfl_refused=refused, cfl_unplaced=unplaced)
        return new

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer joins the cluster whose model has the lowest loss on its training data."""
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "the lowest-loss cluster model"
