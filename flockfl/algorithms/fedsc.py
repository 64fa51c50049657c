"""FedSC — Wang, Liu, Xu, Fu, "FedSC: A federated learning algorithm based on client-side
clustering", Electronic Research Archive 31(9):5226–5249 (2023), doi 10.3934/era.2023266
(seed 000; spec ``core-and-clustered-algorithms.md`` §3.2).

Before federation every client sends its data attribute, the label-proportion vector
I_i = [n_i1/n_i, …, n_iC/n_i]; the server clusters the vectors bottom-up with complete linkage,
D(p, q) = max{‖I_i − I_j‖₂ : i ∈ p, j ∈ q}, until ``algorithm.k`` (the paper's N) clusters
remain.

Training is chained through the clusters: the global model w visits cluster 1, then cluster 2
starting from w_1, …, then cluster N, and starts over. Here one flockfl round is one such
cycle, so a "communication process" of the paper is k rounds: round t trains cluster
``order[t mod k]`` (``algorithm.order``: by index, or a fresh random permutation of the
clusters every k rounds), sampling up to ``train.clients_per_round`` of that cluster's clients
(E local epochs each), and w ← w − η_g Σ (|D_i|/n_S) (w − w_i) (η_g = ``algorithm.server_lr``, 1:
sample-weighted averaging). ``algorithm.schedule=simultaneous`` instead samples from every
cluster in the same round, in proportion to the cluster sizes. There is one global model.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl import clustering
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.rng import np_rng


class FedSC(Algorithm):
    name = "fedsc"
    family = "clustered"
    one_cluster_is_fedavg = True
    paper = "Wang, Liu, Xu, Fu, FedSC: client-side clustering, Electronic Research Archive 31(9) 2023"
    hyperparameters = (
        weighting("samples", source="paper", note="§3.3: w − η Σ (|D_i|/n_S) Δw_i"),
        integer("k", 2, "number of client clusters (the paper's N)", "N", ge=1, source="library",
                note="no value is recoverable; the paper finds more clusters better"),
        choice("schedule", "chained", ("chained", "simultaneous"), "one cluster per round, chained (paper), "
               "or a stratified sample of every cluster each round", source="paper",
               note="§3.3: the model is chained through the clusters"),
        choice("order", "index", ("index", "random"), "chained order: cluster index, or a random permutation per pass",
               source="paper", note="§3.3: cluster 1, 2, …, N, then again"),
        real("server_lr", 1.0, "server step on the weighted mean update (1 = averaging)", "η_g", gt=0, source="library",
             note="the seed uses η for both rates; 1 is sample-weighted averaging"),
    )

    def pre_federation(self, state, ctx):
        hist = np.stack([np.bincount(ctx.data.train.client(int(c))[1].cpu().numpy(), minlength=ctx.data.num_classes)
                         for c in ctx.seen])
        props = clustering.label_proportions(hist)
        dist = np.sqrt(((props[:, None, :] - props[None, :, :]) ** 2).sum(-1))
        labels = clustering.hierarchical_clusters(dist, n_clusters=min(self.cfg.algorithm.k, len(ctx.seen)), linkage="complete")
        groups = np.full(ctx.num_clients, -1, np.int64)
        groups[ctx.seen] = labels
        return state.replace(algo={**state.algo, "groups": torch.from_numpy(groups)},
                             meta={**state.meta, "pre_federation_bytes": {"up": int(props.size * 4), "down": 0}})

    def select(self, state, ctx, round):
        groups = state.algo["groups"].numpy()
        z = int(groups.max()) + 1
        per_round = self.cfg.train.clients_per_round
        rng = np_rng(ctx.seed, round, purpose="select")
        if self.cfg.algorithm.schedule == "simultaneous":
            members = [np.flatnonzero(groups == j) for j in range(z)]
            share = np.array([len(m) for m in members], float) / sum(len(m) for m in members) * per_round
            counts = np.maximum(1, np.round(share).astype(int))
            return np.sort(np.concatenate([rng.choice(m, size=min(c, len(m)), replace=False) for m, c in zip(members, counts)]))
        cycle, pos = divmod(round, z)
        order = (np_rng(ctx.seed, cycle, purpose="fedsc/order").permutation(z) if self.cfg.algorithm.order == "random"
                 else np.arange(z))
        members = np.flatnonzero(groups == order[pos])
        return np.sort(rng.choice(members, size=min(per_round, len(members)), replace=False))

    def aggregate(self, state, ctx, spec, result, assign):
        step = self.pseudo_gradient(state, result)  # Σ (|D_i|/n_S)(w − w_i)
        eta = float(self.hp("server_lr"))
        models = {k: (v[0] - eta * step[k]).unsqueeze(0) for k, v in state.models.items()}
        return self._with_assignments(state, models, result.clients, assign)
