"""How many clusters the evidence supports: one criterion shared by every ``auto`` key.

Every clustered method ends in evidence about its clients: a distance matrix (PACFL's principal
angles, FLIS's 1 − inference similarity, CFL's 1 − cosine of the updates) or an embedding
(FlexCFL's and IFCA's pre-training updates, FedAC's projected models). The candidates are the
partitions the method itself would make at each number of clusters k (the cuts of its own
dendrogram, or its k-means at each k); each is scored by the **mean silhouette** on the method's
own distances (Rousseeuw 1987; ``sklearn.metrics.silhouette_score(metric="precomputed")``), and
the best k wins (ties: the fewer clusters). The **one-cluster test** is Kaufman & Rousseeuw's
reading of the silhouette ("Finding Groups in Data", 1990, ch. 2): a best mean silhouette at or
below 0.25 means "no substantial structure has been found", and then one cluster is chosen. The
silhouette is scale-free (a ratio of distances), so neither the floor nor the choice depends on
the units of the measure (degrees, similarities, parameter norms), which is what made β transfer
so badly between data sets.

The **margin** says how clear the choice was, in silhouette units: for k > 1, the lesser of the
lead over the runner-up k and the height above the floor; for one cluster, how far the best
partition stays below the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from flockfl.clustering.groups import cosine_matrix

CRITERION = "silhouette"
FLOOR = 0.25  # Kaufman & Rousseeuw (1990): mean silhouette ≤ 0.25, "no substantial structure"
NESTED = 0.5  # ... and > 0.5, "a reasonable structure": what a group already found must show to be split again


@dataclass
class Choice:
    """The outcome: ``k`` clusters with ``labels`` (renumbered 0..k−1), the method's value that
    makes them (a threshold; None where none applies, e.g. one cluster cut above every merge),
    the winning ``score``, the ``margin`` and every candidate's ``curve`` entry."""

    k: int
    labels: np.ndarray
    value: Optional[float]
    score: float
    margin: float
    curve: list[dict] = field(default_factory=list)
    reason: str = ""
    chosen: Optional["Choice"] = None  # where a method overrides the criterion (FLIS-DC, unconfirmed): its own choice

    def record(self, key: str, algorithm: str, round: int, **extra) -> dict:
        """A JSON-able record of the decision (what ``flockfl run --json``, MLflow and ``flockfl
        report`` show)."""
        return {"key": key, "algorithm": algorithm, "round": int(round), "criterion": CRITERION, "floor": FLOOR,
                "nested": NESTED,
                "k": int(self.k), "value": None if self.value is None else float(self.value),
                "score": _num(self.score), "margin": _num(self.margin), "clients": int(len(self.labels)),
                "reason": self.reason, "curve": self.curve, **extra}


def _num(x: float) -> Optional[float]:
    return float(x) if np.isfinite(x) else None


def as_distance(dist: np.ndarray) -> np.ndarray:
    """A valid precomputed distance matrix: float64, symmetric (mean of both triangles), zero
    diagonal, no negative entries (rounding)."""
    d = np.asarray(dist, np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"choose: the distance matrix must be square, got shape {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("choose: the distance matrix holds NaN or inf; the clients' evidence is broken")
    d = np.clip((d + d.T) / 2, 0.0, None)
    np.fill_diagonal(d, 0.0)
    return d


def silhouette(dist: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette of ``labels`` on the precomputed ``dist`` (NaN unless 2 ≤ k ≤ n − 1)."""
    from sklearn.metrics import silhouette_score

    k = len(np.unique(labels))
    if not 2 <= k <= len(labels) - 1:
        return float("nan")
    return float(silhouette_score(dist, labels, metric="precomputed"))


def choose(dist: np.ndarray, candidates: list[tuple[np.ndarray, Optional[float]]],
           sub_score: Callable[[np.ndarray], float]) -> Choice:
    """Pick among ``candidates`` ((labels, the method's value that makes them), any order).

    1. The candidate with the best mean silhouette on ``dist`` (ties: fewer clusters); if that
       is ≤ :data:`FLOOR`, one cluster (value None): no substantial structure.
    2. Nested groups: while some cluster of the pick has *reasonable* structure of its own
       (``sub_score(members)``, the best mean silhouette among the method's partitions of those
       clients alone, > :data:`NESTED`, Kaufman & Rousseeuw's "reasonable structure"), move to the
       next finer candidate, as long as that candidate is itself a reasonable partition (mean
       silhouette > 0.5), and keep the finer cut only if the walk ends at one whose every cluster
       is ≤ 0.5: a method with one threshold cuts every cluster at the same height, and walking
       down to one noisy cluster's inner split would shred all the others (FLIS-HC on disjoint
       label groups, seed 1: one group's pair at 0.51 would take the cut from k = 3 to k = 21;
       FLIS-DC, round 2 of seed 0: to k = 7 with that cluster still whole). Rotated digits under
       PACFL are the case for it: 0°/180° against 90°/270° is the coarsest level and has the best
       mean silhouette (0.74), yet each half splits again at 0.58; the finer cuts stay reasonable
       (0.66, 0.56) and the 4-group cut's clusters are homogeneous (0.15). A refinement asks for
       more evidence than the first split (0.5 against 0.25) because a group found at a coarser
       level is already explained, and a noisy measure (FLIS's inference similarity inside one
       group of digits clients scores 0.38) must not shred it.
    """
    from flockfl.clustering.hierarchy import renumber

    d = as_distance(dist)
    n = len(d)
    memo: dict[tuple, float] = {}

    def worst(labels: np.ndarray) -> float:
        out = -np.inf
        for c in range(int(labels.max()) + 1):
            members = np.flatnonzero(labels == c)
            key = tuple(members.tolist())
            if key not in memo:
                memo[key] = sub_score(members) if len(members) >= 3 else -np.inf
            out = max(out, memo[key])
        return out

    rows, seen = [], set()
    for labels, value in candidates:
        labels = renumber(np.asarray(labels))
        k = int(labels.max()) + 1
        if k not in seen and 2 <= k <= n - 1:
            seen.add(k)
            rows.append((k, labels, value))
    rows.sort(key=lambda r: r[0])
    curve = [{"k": k, "value": None if v is None else float(v), "score": silhouette(d, lab), "worst_cluster": None}
             for k, lab, v in rows]
    one = Choice(1, np.zeros(n, np.int64), None, float("nan"), float("nan"), curve)
    if not rows:
        one.reason = f"{n} clients: too few to compare partitions (a silhouette needs 2 ≤ k ≤ n − 1)"
        return one
    scores = np.array([c["score"] for c in curve])
    best = int(np.argmax(scores))  # the first maximum: the fewest clusters among ties
    top = float(scores[best])
    runner = float(np.max(np.delete(scores, best))) if len(scores) > 1 else -1.0
    if top <= FLOOR:
        one.score, one.margin = top, FLOOR - top
        one.reason = f"best mean silhouette {top:.3f} (k={curve[best]['k']}) ≤ {FLOOR}: no substantial structure"
        return one
    pick, steps, kept = best, [], False
    while True:
        w = worst(rows[pick][1])
        curve[pick]["worst_cluster"] = _num(w)
        if not w > NESTED or pick + 1 >= len(rows):
            break
        if not scores[pick + 1] > NESTED:  # the finer cut would not be a reasonable partition as a whole
            steps.append(f"k={rows[pick][0]} leaves a cluster at {w:.3f} > {NESTED}, but the next cut (k="
                         f"{rows[pick + 1][0]}) has a mean silhouette of {scores[pick + 1]:.3f} ≤ {NESTED}: kept")
            kept = True
            break
        steps.append(f"k={rows[pick][0]} leaves a cluster at {w:.3f} > {NESTED}")
        pick += 1
    if pick != best and (kept or (curve[pick]["worst_cluster"] or -1.0) > NESTED):
        # the walk ended without a cut whose every cluster is homogeneous: it only shredded the
        # other clusters (one threshold cuts them all), so the best-scoring cut stands
        steps.append(f"no reasonable finer cut resolves it: k={rows[best][0]} kept")
        pick, kept = best, True
    k, labels, value = rows[pick]
    w = curve[pick]["worst_cluster"]
    margin = (min(top - runner, top - FLOOR) if pick == best else
              min(NESTED - (w if w is not None else -1.0), curve[pick - 1]["worst_cluster"] - NESTED, scores[pick] - NESTED))
    reason = f"best mean silhouette {top:.3f} at k={rows[best][0]} (runner-up {runner:.3f}, floor {FLOOR})"
    if steps:
        reason += "; nested groups: " + ", ".join(steps) + ("" if kept else f"; at k={k} every cluster is ≤ {NESTED}")
    return Choice(k, labels, value, float(scores[pick]), float(margin), curve, reason)


def cut_candidates(d: np.ndarray, linkage: str) -> list[tuple[np.ndarray, float]]:
    """(labels, threshold) for every k = 2..n that a threshold can cut the dendrogram into:
    midway between the (n−k)-th and (n−k+1)-th merge heights (a k skipped by tied heights is not
    offered)."""
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as scipy_linkage
    from scipy.spatial.distance import squareform

    n = len(d)
    if n < 2:
        return []
    z = scipy_linkage(squareform(d, checks=False), method=linkage)
    h = z[:, 2]  # non-decreasing for the monotone linkages flockfl uses
    out = []
    for k in range(2, n + 1):
        lo = h[n - k - 1] if n - k - 1 >= 0 else 0.0
        hi = h[n - k]
        if not hi > lo:
            continue
        t = float((lo + hi) / 2)
        out.append((fcluster(z, t=t, criterion="distance"), t))
    return out


def best_split_score(d: np.ndarray, candidates: list[tuple[np.ndarray, Optional[float]]]) -> float:
    """The best mean silhouette among ``candidates`` with 2 ≤ k ≤ n − 1 (−inf if none)."""
    scores = [silhouette(d, labels) for labels, _ in candidates]
    scores = [s for s in scores if np.isfinite(s)]
    return max(scores) if scores else -np.inf


def choose_cut(dist: np.ndarray, linkage: str, score_on: Optional[np.ndarray] = None) -> Choice:
    """:func:`choose` over the cuts of the agglomerative dendrogram of ``dist`` (the method's own
    ``linkage``); ``value`` is the cut's threshold in the units of ``dist`` (None for one
    cluster: a cut above the highest merge). A cluster's sub-partitions are the cuts of its own
    dendrogram (the subtree, for these linkages). The silhouettes are taken on ``dist``, or on
    ``score_on`` where the method clusters a derived matrix (FlexCFL's MADC, a distance between
    rows of cosines) and the evidence is another (the cosines of the updates)."""
    d = as_distance(dist)
    s = d if score_on is None else as_distance(score_on)

    def sub(members: np.ndarray) -> float:
        idx = np.ix_(members, members)
        return best_split_score(s[idx], cut_candidates(d[idx], linkage))

    return choose(s, cut_candidates(d, linkage), sub)


def choose_kmeans(x: np.ndarray, seed: int, dist: Optional[np.ndarray] = None,
                  partition: Optional[Callable[[np.ndarray, int], np.ndarray]] = None) -> Choice:
    """:func:`choose` over k-means of the rows of ``x`` at each k = 2..min(n − 1, 20), scored on
    ``dist`` (default: Euclidean distances of the rows, k-means' own geometry). ``partition(rows,
    k)`` replaces scikit-learn's ``KMeans(k, n_init=10, random_state=seed)`` where a method has
    its own (FlexCFL's EDC + k-means). A cluster's sub-partitions are the same k-means of its rows."""
    from scipy.spatial.distance import pdist, squareform

    from flockfl.clustering.hierarchy import kmeans_labels

    x = np.asarray(x, np.float64).reshape(len(x), -1)
    d = as_distance(squareform(pdist(x)) if dist is None else dist)
    make = partition or (lambda rows, k: kmeans_labels(x[rows], k, seed))

    def cands(rows: np.ndarray) -> list:
        return [(make(rows, k), None) for k in range(2, min(20, len(rows) - 1) + 1)]

    def sub(members: np.ndarray) -> float:
        return best_split_score(d[np.ix_(members, members)], cands(members))

    return choose(d, cands(np.arange(len(x))), sub)


def cosine_distance(x: np.ndarray) -> np.ndarray:
    """1 − cos between the rows of ``x`` (:func:`~flockfl.clustering.groups.cosine_matrix`: a
    zero row is at distance 1 from everything)."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    return 1.0 - cosine_matrix(x, x)
