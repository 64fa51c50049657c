"""The reports over rounds: which clients have trained by when, each report mode's value of a
metric over the evaluated rounds (final, best, best after all were seen, mean of the last
``last_k``), and the run's summary under its protocol (:func:`summarise`). The protocols and
metric names are in :mod:`flockfl.eval_protocol`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from flockfl.eval_protocol import AVERAGES, REPORTS, TEST_SETS, Protocol, variant
from flockfl.state import DriverRecord

if TYPE_CHECKING:
    from flockfl.state import ServerState


def note_trained(driver: DriverRecord, trained: np.ndarray, seen: np.ndarray, round_no: int) -> DriverRecord:
    """Track which federating clients have trained; ``all_trained_round`` becomes the first
    round (1-based, as history rows count) by which every one of them has."""
    if driver.all_trained_round is not None or len(seen) == 0:
        return driver
    n = int(seen.max()) + 1
    done = np.unpackbits(driver.trained, count=n).astype(bool) if driver.trained is not None else np.zeros(n, bool)
    trained = np.asarray(trained, np.int64)
    done[trained[trained < n]] = True
    if done[seen].all():
        return dataclasses.replace(driver, trained=None, all_trained_round=int(round_no))
    return dataclasses.replace(driver, trained=np.packbits(done))


def reported(rows: list[dict], key: str, mode: str, last_k: int, all_trained: Optional[int]) -> Optional[tuple[float, int]]:
    """(value, round) of ``key`` under a report mode over the evaluated rows that have it
    (``mean_last``: the mean of the last ``last_k`` and the last round); None if none qualifies."""
    have = [(float(r[key]), int(r["round"])) for r in rows
            if key in r and not (isinstance(r[key], float) and math.isnan(r[key]))]
    if mode == "best_after_all_seen":
        have = [h for h in have if all_trained is not None and h[1] >= all_trained]
    if not have:
        return None
    if mode == "final":
        return have[-1]
    if mode == "mean_last":
        tail = have[-last_k:]
        return float(np.mean([v for v, _ in tail])), tail[-1][1]
    best = max(v for v, _ in have)
    return best, next(r for v, r in have if v == best)


def report_modes(rows: list[dict], last_k: int, all_trained: Optional[int]) -> dict[str, float]:
    """Every report mode of every mean accuracy variant in ``rows``
    (``accuracy__label_union__clients__best``), for the last round's row."""
    names = sorted({k for r in rows for k in r if "accuracy" in k and k.count("__") == 2})
    out = {}
    for k in names:
        for mode in REPORTS:
            got = reported(rows, k, mode, last_k, all_trained)
            if got is not None:
                out[f"{k}__{mode}"] = got[0]
    return out


def time_to_target(history: list[dict], target: Optional[float]) -> dict[str, Any]:
    """The first evaluated round whose mean accuracy reaches ``target``, and its sim_time."""
    if target is None:
        return {}
    hit = next((h for h in history if h.get("accuracy", -1.0) >= target), None)
    return {"target_accuracy": target, "rounds_to_target": hit["round"] if hit else None,
            "sim_time_to_target": hit["sim_time"] if hit else None}


SUMMARY_KEYS = (
    "accuracy", "accuracy_min", "accuracy_p10", "loss", "accuracy_personal", "accuracy_personal_min",
    "accuracy_personal_p10", "accuracy_global", "accuracy_finetuned", "accuracy_finetuned_min", "accuracy_finetuned_p10",
    "loss_finetuned", "unseen_accuracy", "unseen_accuracy_p10", "unseen_accuracy_untuned", "ari", "nmi", "num_clusters",
    "min_dist", "sim_time", "accuracy_pruned", "accuracy_pruned_min", "accuracy_pruned_p10", "accuracy_pruned_finetuned",
    "sparsity", "channel_sparsity", "comm_bytes", "comm_bytes_thesis")


def summarise(state: ServerState, target: Optional[float] = None) -> dict[str, Any]:
    """The run's metrics under its protocol (``state.driver.eval_protocol``): every accuracy
    family from the round its report mode picks, everything else from the last round; the
    protocol itself (with the round ``accuracy`` comes from and when every client had trained),
    every report mode of every convention of ``accuracy``, the median round time leaving out
    the first round, and time to target."""
    proto = Protocol(**(state.driver.eval_protocol or {}))
    rows = state.history
    last = rows[-1] if rows else {}
    all_trained = state.driver.all_trained_round
    metrics: dict[str, Any] = {}
    for k in SUMMARY_KEYS:
        if "accuracy" in k:
            got = reported(rows, k, proto.report, proto.last_k, all_trained)
            if got is not None:
                metrics[k] = got[0]
        elif k in last and not (isinstance(last[k], float) and math.isnan(last[k])):
            metrics[k] = last[k]
    # every convention's reported values (``accuracy__label_union__clients__best``): the last row's
    metrics.update({k: float(v) for k, v in last.items() if k.count("__") == 3 and isinstance(v, (int, float))
                    and not (isinstance(v, float) and math.isnan(v))})
    headline = reported(rows, "accuracy", proto.report, proto.last_k, all_trained)
    reports = {f"{ts}/{avg}": {mode: got[0] for mode in REPORTS
                               if (got := reported(rows, variant("accuracy", ts, avg), mode, proto.last_k, all_trained))}
               for ts in TEST_SETS for avg in AVERAGES}
    times = [h["round_time_s"] for h in rows[1:]] or [h["round_time_s"] for h in rows]
    return {"metrics": metrics,
            "protocol": {**proto.asdict(), "accuracy_round": headline[1] if headline else None,
                         "all_trained_round": all_trained},
            "reports": {k: v for k, v in reports.items() if v},
            "round_s_median": float(np.median(times)) if times else float("nan"),
            **time_to_target(rows, target)}
