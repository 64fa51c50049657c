"""Evaluation of what changed (``eval.reuse``): seconds of each round's evaluation with and
without reuse, in a personal-model run where few clients train a round.

Runs (evaluation every round, the plain loop, no Prefect or MLflow): ``local`` and ``ditto`` on
Fashion-MNIST shards (2 classes per client, MLP 784-200-10) with ``--clients`` clients and 10 %
of them a round. Each run goes once with ``eval.reuse=true`` and once with ``false``; the
evaluation stage is timed round by round (``rounds.evaluate_stage``), and the two histories are
checked to be equal (all but wall times) before the table is printed.

Usage: python benchmarks/eval_reuse.py [--clients 500] [--rounds 10] [--threads 1] [--runs local,ditto]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FMNIST = "/usr/share/datasets/fashion-mnist"


def config(algorithm: str, clients: int, rounds: int, threads: int, reuse: bool) -> dict:
    return {"name": "eval-reuse", "seed": 0, "dataset": {"name": "fashion_mnist", "path": FMNIST},
            "model": {"name": "mlp", "hidden": 200}, "algorithm": {"name": algorithm},
            "partition": {"scheme": "shards", "num_clients": clients, "classes_per_client": 2},
            "train": {"rounds": rounds, "clients_per_round": max(1, clients // 10), "engine": "vectorized",
                      "threads": threads, "batch_size": 50, "eval_every": 1},
            "eval": {"reuse": reuse}, "tracking": {"enabled": False}}


def timed_run(raw: dict, parts: str) -> tuple[list[float], list[dict], list]:
    """Each round's evaluation seconds, the history, and each evaluation's counts."""
    from flockfl.experiments import validate
    from flockfl.rounds import PLAIN, drive, evaluate_stage, prepare

    seconds, counts = [], []

    def evaluate(prep, state, r):
        t = time.perf_counter()
        m = evaluate_stage(prep, state, r)
        seconds.append(time.perf_counter() - t)
        counts.append(m["_eval_reuse"].counts if m["_eval_reuse"] is not None else None)
        return m

    state = drive(prepare(validate(raw), parts), None, dataclasses.replace(PLAIN, evaluate=evaluate))
    return seconds, state.history, counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", default="local,ditto")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="eval-reuse-")  # removed when the script ends
    parts = tmp.name
    strip = lambda h: {k: v for k, v in h.items() if k != "round_time_s"}  # noqa: E731
    print(f"{a.clients} clients, {max(1, a.clients // 10)} a round, {a.rounds} rounds, evaluation every round, "
          f"{a.threads} thread(s)\n")
    print("| run | eval.reuse | first evaluation s | later evaluations s (median) | clients measured a later round (median) |")
    print("|---|---|---:|---:|---:|")
    for alg in a.runs.split(","):
        got = {}
        for reuse in (False, True):
            got[reuse] = timed_run(config(alg, a.clients, a.rounds, a.threads, reuse), parts)
        assert [strip(h) for h in got[True][1]] == [strip(h) for h in got[False][1]], f"{alg}: histories differ"
        for reuse in (False, True):
            sec, _, counts = got[reuse]
            measured = (f"{np.median([c['measured'] for c in counts[1:]]):.0f} (+{np.median([c['reused'] for c in counts[1:]]):.0f} reused)"
                        if reuse else "all")
            print(f"| {alg} | {str(reuse).lower()} | {sec[0]:.3f} | {np.median(sec[1:]):.3f} | {measured} |")
    print("\n(histories with and without reuse equal, all but wall times)")


if __name__ == "__main__":
    main()
