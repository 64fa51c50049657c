"""PACFL — Vahidian, Morafah, Wang, Kungurtsev, Chen, Shah, Lin, "Efficient Distribution
Similarity Identification in Clustered Federated Learning via Principal Angles Between Client
Data Subspaces", https://arxiv.org/abs/2209.10526 (thesis seed 001, §3.4, Algorithms 7–9;
spec ``flis-pacfl-scniid.md`` §2; official code MMorafah/PACFL).

Before federation, every client sends one signature U_p: the p most significant left singular
vectors of its data matrix (``algorithm.signature``: ``per_class`` stacks the SVD of each
class's samples, as the official code; ``whole`` takes the SVD of all local data, as the
thesis text). The server builds the proximity matrix (``algorithm.measure``):

    code     A_ij = min_{a,b} arccos((U_iᵀ U_j)_ab)         min over all column pairs (official_min_pairwise)
    Eq. 3.1  A_ij = Θ_1(U_i, U_j)                      smallest principal angle (smallest_angle)
    Eq. 3.2  A_ij = tr(arccos(|U_iᵀ U_j|))              matched columns (trace)

(or Σ_k Θ_k, ``sum_angles``), in degrees, and cuts an agglomerative clustering at the distance
``algorithm.beta`` (larger β: fewer clusters; β → ∞ is FedAvg, β → 0 is local training) or at
``algorithm.k`` clusters.

The defaults are one published configuration taken together, the official code's
(MMorafah/PACFL ``main_pacfl.py``, ``scripts/pacfl.sh``): per-class signatures with p = 3, the
min-pairwise measure, WPGMA linkage, cut at β. The thesis's own configuration is incomplete (it
names no linkage and gives β only in plots, Figs. 3.13–3.14), so it cannot be the default; its
signature and measures are options. β has no default: it is in degrees of the chosen measure on
the given data, and the code's own scripts use 4.9 (CIFAR-10, 2 labels per client) and 42
(MIX-4); left unset (and without ``k``), the config stops with one line naming
``algorithm.beta``. ``algorithm.cut=largest_gap`` [I: a rule of ours, not PACFL's] cuts the
dendrogram at its largest gap between consecutive merge heights when the upper height is at
least ``algorithm.gap_ratio`` times the lower one, else keeps one cluster (which is FedAvg):
"PACFL + largest-gap cut" in tables.

``measure=class_matched`` [I, not in the thesis or the code] compares the per-class subspaces
of the same label: A_ij = mean over the labels either client holds of Θ_1(U_i^c, U_j^c) (90° for
a label only one of them holds). Eq. 3.1–3.2 compare the span of a client's data, which is the
same under a pure label permutation (concept shift, identical P(x)); ``class_matched`` keeps the
class identity of the per-class signature, which is what lets PACFL separate label-swapped
clients at all.
``algorithm.linkage`` defaults to the code's "average", which merges rows by their mean
(WPGMA, SciPy's ``weighted``). Then FedAvg runs inside each cluster.

Newcomers (Alg. 8, PME, and Alg. 9): a newcomer sends its signature; ``newcomer_mode=stable``
attaches it to the cluster at the smallest linkage distance if that is ≤ β (with ``k``: always
the nearest), else opens a new cluster from θ_g^0; ``recluster`` re-runs the clustering on the
extended matrix and maps clusters to old ids by largest overlap. Then it fine-tunes.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl import clustering
from flockfl.algorithms.auto import recorded
from flockfl.algorithms.hyper import choice, declared, integer, is_auto, missing, real, weighting
from flockfl.clustering.choose import choose_cut
from flockfl.algorithms.oneshot import OneShotClustering
from flockfl.state import ServerState


def client_signatures(ctx, clients: np.ndarray, p: int, mode: str) -> list[np.ndarray]:
    """U_p of every listed client's training data (float64, features × columns)."""
    out = []
    for c in clients:
        x, y = ctx.data.train.client(int(c))
        out.append(clustering.client_signature(x.cpu().numpy(), y.cpu().numpy(), p, mode))
    return out


class PACFL(OneShotClustering):
    name = "pacfl"
    paper = "Vahidian et al., Principal Angles analysis for Clustered FL, arXiv 2209.10526 (thesis §3.4)"
    hyperparameters = (
        weighting("samples", source="thesis", note="Alg. 7: the |D_k|-weighted mean of each cluster"),
        integer("p", 3, "left singular vectors per signature (per class with signature=per_class)", "p", ge=1,
                source="code", note="scripts/pacfl.sh --n_basis=3 (argparse default 5); the thesis's Tables 3.8-3.9 "
                                    "use p = 3 too"),
        choice("signature", "per_class", ("per_class", "whole"), "SVD of each class's samples, stacked (code), "
               "or of all local data (thesis text)", source="code",
               note="main_pacfl.py: the SVD of each label's raw samples, stacked"),
        choice("measure", "official_min_pairwise", ("official_min_pairwise", "smallest_angle", "trace", "sum_angles",
                                                    "class_matched"),
               "proximity: the code's min pairwise angle, Eq. 3.1 smallest principal angle, Eq. 3.2 matched-column "
               "trace, Σ of all principal angles, or Eq. 3.1 per shared label (class_matched; degrees)", source="code",
               note="calculating_adjacency: min over all column pairs of arccos(U_iᵀU_j), in degrees"),
        choice("cut", "beta", ("beta", "largest_gap"), "where the dendrogram is cut: at the distance β (or at k "
               "clusters when k is set), or at its largest gap (largest_gap, a library rule: one cluster = FedAvg "
               "when no gap is clear)", source="code", note="hierarchical_clustering stops once the closest pair is "
                                                            "farther than β"),
        real("beta", None, "clustering threshold in degrees of the measure: larger gives fewer clusters (not used "
             "when k is set or cut=largest_gap); auto: the dendrogram cut with the best mean silhouette, one cluster "
             "if none clears 0.25 (flockfl.clustering.choose; 'PACFL + auto β' in tables)", "β", gt=0, auto=True,
             source="data",
             note="the official code: 4.9 on CIFAR-10 with 2 labels per client and p = 3 (scripts/pacfl.sh), 42 on "
                  "MIX-4, argparse default 3.5; the thesis sweeps it per dataset, Figs. 3.13-3.14"),
        real("gap_ratio", 2.0, "cut=largest_gap: cut only where the next merge is this many times higher", gt=1,
             source="library"),
        integer("k", None, "a fixed number of clusters instead of the threshold β", "Z", ge=1, optional=True,
                source="library", note="the thesis's Table 3.20 reports 2 clusters for FMNIST and 4 for MIX-4"),
        choice("linkage", "weighted", ("weighted", "average", "complete", "single"),
               "hierarchical linkage; weighted = the code's 'average' (WPGMA)", source="code",
               note="--linkage=average: merged rows are the mean of the two (WPGMA)"),
        choice("newcomer_mode", "stable", ("stable", "recluster"), "how newcomers join (PME): attach to the "
               "nearest cluster within β, or re-cluster and keep old ids by overlap", source="library",
               note="Alg. 8 re-clusters, which can relabel old clusters (spec §2.5)"),
    )

    @classmethod
    def check_config(cls, cfg):
        """β has no published default (it depends on the data and the measure): without β, k or
        cut=largest_gap the run would have no threshold, so the config stops here."""
        a = cfg.algorithm
        if a.cut == "largest_gap" and (a.beta is not None or a.k is not None):
            raise ValueError(f"algorithm.cut: largest_gap picks the cut itself, so it takes neither algorithm.beta nor "
                             f"algorithm.k (given beta={a.beta}, k={a.k}); drop them or set algorithm.cut=beta")
        if is_auto(a.beta) and a.k is not None:
            raise ValueError(f"algorithm.beta: auto chooses the number of clusters itself, so it takes no algorithm.k "
                             f"(given k={a.k}); drop algorithm.k or set a numeric beta")
        if a.cut == "beta" and a.beta is None and a.k is None:
            raise missing(cls.name, declared(cls)["beta"], ", or algorithm.k (a number of clusters), or "
                                                          "algorithm.cut=largest_gap")

    def threshold(self, dist: np.ndarray) -> float | None:
        """β, or the largest-gap cut (inf: one cluster); None when k is set and β is not."""
        a = self.cfg.algorithm
        return largest_gap_threshold(dist, a.linkage, a.gap_ratio) if a.cut == "largest_gap" else a.beta

    def cut(self, dist: np.ndarray, threshold: float | None = None) -> np.ndarray:
        a = self.cfg.algorithm
        if a.k is not None:
            return clustering.hierarchical_clusters(dist, n_clusters=min(a.k, len(dist)), linkage=a.linkage)
        beta = self.threshold(dist) if threshold is None else threshold
        if not np.isfinite(beta):
            return np.zeros(len(dist), np.int64)
        return clustering.hierarchical_clusters(dist, threshold=beta, linkage=a.linkage)

    def signatures(self, ctx, clients: np.ndarray) -> list:
        a = self.cfg.algorithm
        if a.measure == "class_matched":
            return [class_bases(*ctx.data.train.client(int(c)), a.p) for c in clients]
        return client_signatures(ctx, clients, a.p, a.signature)

    def proximity(self, sigs_a: list, sigs_b: list | None = None) -> np.ndarray:
        """A (square, when ``sigs_b`` is None) or the cross block, in degrees, rounded to 1e-9°:
        the SVDs behind it come from the installed LAPACK, whose last bits differ between numpy
        builds; rounded, the matrix (kept in the run state) and the cut do not."""
        m = self.cfg.algorithm.measure
        if m == "class_matched":
            b = sigs_a if sigs_b is None else sigs_b
            prox = np.array([[class_matched_angle(u, w) for w in b] for u in sigs_a])
        elif sigs_b is None:
            prox = clustering.proximity_matrix(sigs_a, m)
        else:
            prox = clustering.cross_proximity(sigs_a, sigs_b, m)
        return np.round(prox, 9)

    def pre_federation(self, state: ServerState, ctx) -> ServerState:
        sigs = self.signatures(ctx, ctx.seen)
        prox = self.proximity(sigs)
        if is_auto(self.cfg.algorithm.beta):
            choice = choose_cut(prox, self.cfg.algorithm.linkage)
            beta = float("inf") if choice.value is None else choice.value  # one cluster: a cut above every merge
            state = recorded(state, choice, "algorithm.beta", self.name, -1, log=False, unit="degrees")
        else:
            beta = self.threshold(prox)
        labels = self.cut(prox, beta)
        state = self.clustered_state(state, ctx, labels, {
            "matrices": {"pacfl_proximity": torch.from_numpy(prox)},
            "matrix_clients": torch.from_numpy(ctx.seen.copy()),
            "beta_used": torch.tensor(float(beta) if self.cfg.algorithm.k is None else float("nan")),
        })
        # each client uploads its signature once (float32); nothing comes down but a cluster id
        return state.replace(meta={**state.meta, "pre_federation_bytes": {"up": sum(signature_floats(s) * 4 for s in sigs),
                                                                          "down": 0}})

    def admit_newcomers(self, state, ctx, newcomers):
        a = self.cfg.algorithm
        old = ctx.seen
        labels = state.assignments[old]
        sig_old, sig_new = self.signatures(ctx, old), self.signatures(ctx, newcomers)
        cross = self.proximity(sig_new, sig_old)  # [new, old]
        beta = float(state.algo["beta_used"])  # the same β as before federation (Alg. 8)
        z = state.k
        if a.newcomer_mode == "recluster":
            full = np.block([[state.algo["matrices"]["pacfl_proximity"].numpy(), cross.T], [cross, self.proximity(sig_new)]])
            joint = self.cut(full, beta)
            assign = map_to_old_ids(joint[: len(old)], labels, joint[len(old):], z)
            rule = "PME + re-clustering (old ids kept by overlap)"
        else:
            assign = np.empty(len(newcomers), np.int64)
            for b in range(len(newcomers)):
                d = clustering.point_to_cluster_distances(cross[b], labels, a.linkage)
                j = int(np.argmin(d))
                if a.k is not None or d[j] <= beta:
                    assign[b] = j
                else:
                    assign[b] = z
                    z += 1
            rule = "PME: nearest cluster by linkage distance" + ("" if a.k is not None else f" if ≤ β={beta:.3g}°, else a new cluster")
        new_state = self.with_new_clusters(state, int(max(assign.max(initial=-1) + 1, state.k) - state.k))
        return new_state, assign, rule

    def comm_bytes(self, state, clients):
        # a known client sends its cluster id and receives its cluster's model, then sends it back
        per_model = self.model_bytes(state)
        return len(clients) * per_model, len(clients) * (per_model + 8)


def map_to_old_ids(joint_old: np.ndarray, old_labels: np.ndarray, joint_new: np.ndarray, z: int) -> np.ndarray:
    """Cluster ids for newcomers after re-clustering: a joint cluster takes the old id that most
    of its old members had; a joint cluster with no old member becomes a new id (z, z+1, ...)."""
    mapping: dict[int, int] = {}
    for j in np.unique(np.concatenate([joint_old, joint_new])):
        members = old_labels[joint_old == j]
        if len(members):
            mapping[int(j)] = int(np.bincount(members).argmax())
        else:
            mapping[int(j)] = z
            z += 1
    return np.array([mapping[int(j)] for j in joint_new], np.int64)


def class_bases(x: torch.Tensor, y: torch.Tensor, p: int) -> dict[int, np.ndarray]:
    """U_p of each label's samples, keyed by label (the per-class signature, class identity kept)."""
    xn, yn = x.cpu().numpy(), y.cpu().numpy()
    return {int(c): clustering.data_basis(xn[yn == c], p) for c in np.unique(yn)}


def class_matched_angle(u: dict[int, np.ndarray], w: dict[int, np.ndarray]) -> float:
    """Mean over the labels either client holds of Θ_1(U^c, W^c) in degrees (90° for a label
    only one of them holds)."""
    labels = sorted(set(u) | set(w))
    angles = [float(np.degrees(clustering.principal_angles(u[c], w[c])[0])) if c in u and c in w else 90.0 for c in labels]
    return float(np.mean(angles))


def signature_floats(sig) -> int:
    return sum(b.size for b in sig.values()) if isinstance(sig, dict) else sig.size


def largest_gap_threshold(dist: np.ndarray, linkage: str, ratio: float) -> float:
    """A cut between the two consecutive merge heights with the largest gap, if the upper one is
    at least ``ratio`` times the lower one; otherwise inf (one cluster)."""
    from scipy.cluster.hierarchy import linkage as scipy_linkage
    from scipy.spatial.distance import squareform

    if len(dist) < 3:
        return float("inf")
    heights = np.sort(scipy_linkage(squareform(dist, checks=False), method=linkage)[:, 2])
    i = int(np.argmax(np.diff(heights)))
    lo, hi = heights[i], heights[i + 1]
    if hi < ratio * max(lo, 1e-9):
        return float("inf")
    return float((lo + hi) / 2)
