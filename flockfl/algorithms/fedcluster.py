"""FedCluster — Chen, Chen, Zhou, Kailkhura, "FedCluster: Boosting the Convergence of Federated
Learning via Cluster-Cycling", https://arxiv.org/abs/2009.10748 (IEEE BigData 2020; seed 000;
spec ``core-and-clustered-algorithms.md`` §3.1).

The clients are split into M clusters S_1…S_M once (``algorithm.cluster_assign``: a seeded
random split into M near-equal parts, or ``given``: the partition's ground-truth groups). Each
round runs M *cycles*: round j draws an order σ_j of the clusters (``cluster_order``: a fresh
random permutation per round from the (seed, round, "fedcluster/order") stream, or ``fixed``),
and cycle K samples up to ``algorithm.per_cycle`` clients S' of cluster σ_j(K) (default:
``train.clients_per_round`` // M, so a round does FedAvg's device work), each runs E local epochs
from the current W, and the server applies one update

    W ← Σ_{k∈S'} (p_k / Σ_{k'∈S'} p_k') · w_k        (``normalize=sampled``, default)
    W ← Σ_{k∈S'} (p_k / q_m) · w_k,  q_m = Σ_{k∈S_m} p_k   (``cluster_mass``, the paper's literal weights)

with p_k = n_k / n (``algorithm.weighting=uniform``: p_k = 1/N). A round therefore makes M global updates, and every client trains at most
once per round. The seed's box samples from S_{K+1} but aggregates over σ_j(K+1); σ_j is used
for both (spec §6 item 5).

Cycles are sub-rounds of the round driver (``cycles_per_round``): the running cycle is in
``state.meta['cycle']`` and a checkpoint is written after every cycle, so a run killed
mid-round resumes at the next cycle, bit-identically. With M = 1 the single cycle draws its
cohort from FedAvg's stream, so FedCluster(M=1) is FedAvg (equal state digests).

Stages act once per round, not per cycle (``flockfl.stages.base``): a distribution shift
happens in the first cycle, before σ_j(1)'s training, and holds for the whole round. A client
curriculum chooses the round's cohort once (``train.clients_per_round`` clients of its paced
pool, as under FedAvg) and cycle K trains the cohort's members of cluster σ_j(K) (so
``per_cycle`` does not apply): the curriculum decides who trains this round, FedCluster the
order and the M sequential updates, and every client still trains at most once per round.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import choice, integer, weighting
from flockfl.rng import np_rng


class FedCluster(Algorithm):
    name = "fedcluster"
    one_cluster_is_fedavg = True
    paper = "Chen, Chen, Zhou, Kailkhura, FedCluster: Boosting the Convergence of FL via Cluster-Cycling, arXiv 2009.10748"
    hyperparameters = (
        weighting("samples", source="paper", note="p_k = n_k / n"),
        integer("k", 2, "number of device clusters M: one global update per cluster per round", "M", ge=1,
                source="library", note="the paper gives no universal value"),
        integer("per_cycle", None, "clients sampled per cycle (None: train.clients_per_round // M, at least 1)",
                "|S'|", ge=1, optional=True, source="library",
                note="so that a round does FedAvg's device work"),
        choice("cluster_order", "random_permutation", ("random_permutation", "fixed"),
               "order of the clusters in a round: a fresh permutation σ_j per round, or by index", source="paper",
               note="σ_j, a random permutation of [M] every round"),
        choice("cluster_assign", "random_equal", ("random_equal", "given"),
               "clusters: a seeded random split into M near-equal parts, or the partition's ground-truth groups",
               source="library", note="the paper allows any static grouping (by availability, region …)"),
        choice("normalize", "sampled", ("sampled", "cluster_mass"),
               "aggregation weights p_k/Σ_{S'} p (sum to 1) or p_k/q_m (the paper's literal weights)", source="paper",
               note="equal to the paper's p_k/q_m when S' is the whole cluster, the one case where those sum to 1"),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.algorithm.cluster_assign == "given" and cfg.partition.scheme not in ("rotated", "label_swap", "mix",
                                                                                    "sc_niid", "sc_dir", "natural"):
            raise ValueError(f"algorithm.cluster_assign: 'given' needs ground-truth groups, which partition.scheme="
                             f"{cfg.partition.scheme} does not have; use random_equal")

    # ------------------------------------------------------------------ clusters
    def clusters(self, ctx) -> np.ndarray:
        """The cluster of every client (-1: a newcomer). A pure function of (seed, the
        federating clients, M), so it is recomputed rather than stored: the state of
        FedCluster(M=1) is then FedAvg's, digest included."""
        cached = getattr(self, "_clusters", None)
        if cached is not None and cached[0] is ctx:
            return cached[1]
        m = min(self.hp("k"), len(ctx.seen))
        clusters = np.full(ctx.num_clients, -1, np.int64)
        if self.hp("cluster_assign") == "given":  # the partition's groups (before any shift)
            _, clusters[ctx.seen] = np.unique(ctx.base_data.group[ctx.seen], return_inverse=True)
        else:
            perm = np_rng(ctx.seed, purpose="fedcluster/assign").permutation(ctx.seen)
            for j, part in enumerate(np.array_split(perm, m)):
                clusters[part] = j
        self._clusters = (ctx, clusters)
        return clusters

    def num_device_clusters(self, ctx) -> int:
        return int(self.clusters(ctx).max()) + 1

    def cycles_per_round(self, state, ctx):
        return self.num_device_clusters(ctx)

    def order(self, state, ctx, round: int) -> np.ndarray:
        """σ_j: the clusters in the order round ``round`` visits them."""
        m = self.num_device_clusters(ctx)
        if self.hp("cluster_order") == "fixed":
            return np.arange(m)
        return np_rng(ctx.seed, round, purpose="fedcluster/order").permutation(m)

    def cycle_candidates(self, state, ctx, round: int) -> np.ndarray:
        """The clients the running cycle (``state.driver.cycle``) draws from: cluster σ_j(K).
        A stage that chooses the round's cohort itself (a client curriculum) has each cycle
        train the cohort's members of this cluster (``flockfl.rounds.cycle_share``)."""
        cycle = state.driver.cycle
        return np.flatnonzero(self.clusters(ctx) == self.order(state, ctx, round)[cycle])

    def select(self, state, ctx, round):
        cycle = state.driver.cycle
        m = self.num_device_clusters(ctx)
        if m == 1:  # FedAvg's own draw: FedCluster(M=1) is FedAvg
            return super().select(state, ctx, round)
        members = self.cycle_candidates(state, ctx, round)
        size = self.hp("per_cycle") or max(1, self.cfg.train.clients_per_round // m)
        rng = np_rng(ctx.seed, round, purpose=f"select/cycle{cycle}")
        return np.sort(rng.choice(members, size=min(size, len(members)), replace=False))

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, state, ctx, spec, result, assign):
        by_samples = self.weighting == "samples"
        p = result.num_samples.astype(np.float64) if by_samples else np.ones(len(result.clients))
        if self.hp("normalize") == "sampled":
            w = p / p.sum()
        else:  # p_k / q_m with q_m the whole cluster's share (of the samples, or of the clients)
            sizes = ctx.data.train.sizes.astype(np.float64) if by_samples else np.ones(ctx.num_clients)
            clusters = self.clusters(ctx)
            w = p / sizes[clusters == clusters[result.clients[0]]].sum()
        models = {k: v.unsqueeze(0) for k, v in weighted_mean(result.params, torch.from_numpy(w)).items()}
        return self._with_assignments(state, models, result.clients, assign)
