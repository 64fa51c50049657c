"""``auto`` keys: a method's threshold or cluster count read from its own evidence.

The criterion is :mod:`flockfl.clustering.choose` (mean silhouette on the method's distances,
with Kaufman & Rousseeuw's one-cluster test). Every decision is kept in the run state,
``state.meta['auto_choices']`` (a list of :meth:`Choice.record` dicts: key, round, k, value,
score, margin and the criterion's curve over the candidates), so a resumed run has it and never
re-decides a past round; ``flockfl run --json`` prints the latest decision per key and a compact
history, MLflow gets them as ``auto_choices.json`` and the curve as ``plots/auto_choice.png``,
and ``flockfl report`` draws the curves of every run beside each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flockfl.clustering import ari
from flockfl.clustering.choose import Choice
from flockfl.state import ServerState, log_round

META_KEY = "auto_choices"


def recorded(state: ServerState, choice: Choice, key: str, algorithm: str, round: int, log: bool = True,
             **extra: Any) -> ServerState:
    """The state with the decision appended to ``meta['auto_choices']``; with ``log`` (a decision
    inside a round) the round's history row gets ``auto_k``, ``auto_score`` and ``auto_margin``
    (and so MLflow's metrics)."""
    rec = choice.record(key, algorithm, round, **extra)
    state = state.replace(meta={**state.meta, META_KEY: list(state.meta.get(META_KEY, [])) + [rec]})
    if log:
        log_round(state, auto_k=choice.k, auto_score=rec["score"] or 0.0, auto_margin=rec["margin"] or 0.0)
    return state


def summary(meta: dict) -> dict:
    """What ``flockfl run --json`` prints under ``auto``: the number of decisions, the latest one
    per key (curve included) and every decision without its curve."""
    recs = meta.get(META_KEY) or []
    latest: dict[str, dict] = {}
    for r in recs:
        latest[r["key"]] = r
    return {"decisions": len(recs), "latest": list(latest.values()),
            "history": [{k: v for k, v in r.items() if k != "curve"} for r in recs]}


def metrics(rec: dict) -> dict[str, float]:
    """A decision as MLflow metrics (``auto_k``, ``auto_value``, ``auto_score``, ``auto_margin``)."""
    return {f"auto_{k}": float(rec[k]) for k in ("k", "value", "score", "margin") if rec.get(k) is not None}


def confirmed(choice: Choice, clients, last: dict | None, round: int) -> bool:
    """A decision made each round on fresh, noisy evidence (CFL's split test, FLIS-DC's β) counts
    only when the round before found the same partition of the clients both rounds saw (ARI 1,
    at least two groups among them): a true structure shows every round, a chance one does not.
    ``last`` is the previous round's :func:`memory`."""
    if choice.k < 2 or not last or last["round"] != round - 1:
        return False
    before = dict(zip(last["clients"], last["labels"]))
    common = [i for i, c in enumerate(np.asarray(clients).tolist()) if c in before]
    if len(common) < 3:
        return False
    prev = np.array([before[int(clients[i])] for i in common])
    return len(np.unique(prev)) > 1 and ari(prev, choice.labels[common]) == 1.0


def memory(choice: Choice, clients, round: int) -> dict:
    """What :func:`confirmed` needs of this round's decision next round (JSON-able, kept in meta)."""
    return {"round": int(round), "clients": np.asarray(clients).tolist(), "labels": choice.labels.tolist()}
