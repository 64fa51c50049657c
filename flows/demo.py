"""The README demo: FedAvg and IFCA on rotated digits, one results table.

Both experiments run in one process, so Prefect's per-process API starts once (first thing,
while torch and MLflow import; see flows/apiserver.py).
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

from flows.env import configure_environment


def main() -> int:
    configure_environment()
    from flows import apiserver

    apiserver.start()
    from flockfl.experiments import load_experiment
    from flows.experiment import run_experiment
    from flows.tracking.store import resolve_tracking_uri

    uri = resolve_tracking_uri(None, None)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    rows = []
    for name in ("fedavg_rotated_digits", "ifca_rotated_digits"):
        cfg = load_experiment(name)
        print(f"running {name}: {cfg.algorithm.name} on {cfg.dataset.name}/{cfg.partition.scheme} "
              f"({cfg.partition.num_clients} clients, {cfg.train.rounds} rounds)", flush=True)
        rows.append(run_experiment(cfg, Path(f"runs/{name}-{stamp}"), "data/partitions", uri))
    print()
    print("| experiment | mean client acc | p10 acc | min acc | ARI | NMI | clusters | s/round | MLflow run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["metrics"]
        print(f"| {r['experiment']} | {m['accuracy']:.3f} | {m['accuracy_p10']:.3f} | {m['accuracy_min']:.3f} | "
              f"{m.get('ari', float('nan')):.3f} | {m.get('nmi', float('nan')):.3f} | {m['num_clusters']} | "
              f"{r['round_s_median']:.3f} | {r['run_id'][:8]} |")
    print()

    print(f"Open the MLflow UI:  .venv/bin/flockfl ui --tracking-uri {uri} --experiment ifca_rotated_digits   "
          f"(it prints the link to the runs, with accuracy, ARI and clusters as columns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
