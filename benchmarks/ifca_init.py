"""IFCA's initialisations on rotated data: ARI, accuracy and clusters found, per seed.

Datasets (``--datasets``):

- ``digits``: params.yaml's ``ifca_rotated_digits`` (40 clients, k = 4 rotations, all 40 per
  round, 2 local epochs, lr 0.1, 30 rounds);
- ``fmnist``: ``configs/ifca_rotated_fmnist.yaml`` (1200 clients × 50 Fashion-MNIST images,
  k = 4 rotations, MLP 784-200-10) with the issue's schedule: 120 clients per round, 1 local
  epoch, lr 0.1, 150 rounds (``--fmnist-rounds`` to shorten).

Rows are named as tables name them: ``random`` is IFCA as the paper starts it (the registry's
default), ``balanced_restart`` the rotated-CIFAR code's redraws ("IFCA + balanced restart"),
``pretrain_kmeans`` the library's option ("IFCA + k-means start": a cohort pre-trains and the
server runs k-means before round 0, so that row also pays a central step).

Each (dataset, init, seed) is one run of ``flockfl.rounds.run_rounds`` (no Prefect, no
MLflow), evaluated once, after the last round (``train.eval_every = rounds``; no fine-tuning
pass). ``seed`` is the experiment seed: it draws the partition, the initial models and the
cohorts. Runs are sequential; set ``OMP_NUM_THREADS=1`` on a shared machine.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/ifca_init.py --datasets digits --seeds 0 1 2 3 4
    OMP_NUM_THREADS=1 python benchmarks/ifca_init.py --datasets fmnist --fmnist-rounds 150 \\
        --inits random balanced_restart pretrain_kmeans
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

INITS = ("random", "balanced_restart", "pretrain_kmeans")
# the row name of each start in a table: only the paper's start is plain "IFCA"
METHOD = {"random": "IFCA", "balanced_restart": "IFCA + balanced restart", "pretrain_kmeans": "IFCA + k-means start"}


def experiment(dataset: str, init: str, seed: int, fmnist_rounds: int, extra: list[str]):
    from flockfl.experiments import load_experiment

    common = [f"seed={seed}", f"algorithm.init={init}", "tracking.enabled=false", "train.threads=1",
              "train.eval_finetune='off'"]
    if dataset == "digits":
        cfg = load_experiment("ifca_rotated_digits", common + extra, ROOT / "params.yaml")
    else:
        cfg = load_experiment(str(ROOT / "configs/ifca_rotated_fmnist.yaml"),
                              common + ["train.clients_per_round=120", "train.local_epochs=1", "train.lr=0.1",
                                        f"train.rounds={fmnist_rounds}"] + extra, ROOT / "params.yaml")
    # one evaluation, after the last round
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": cfg.train.rounds})})


def run_one(dataset: str, init: str, seed: int, fmnist_rounds: int, extra: list[str], parts: str) -> dict:
    from flockfl.rounds import prepare, run_rounds

    cfg = experiment(dataset, init, seed, fmnist_rounds, extra)
    t0 = time.perf_counter()
    prep = prepare(cfg, parts)
    t_init = time.perf_counter()
    state = prep.algorithm.init_state(prep.ctx)
    t_init = time.perf_counter() - t_init
    state = run_rounds(prep, state)
    last = state.history[-1]
    pre = state.driver.pre_federation or {}
    return {"dataset": dataset, "init": init, "seed": seed, "rounds": cfg.train.rounds, "ari": last.get("ari"),
            "accuracy": last.get("accuracy"), "clusters": last.get("num_clusters"),
            "sizes": [last.get(f"cluster/{j}/clients", 0) for j in range(cfg.algorithm.k)],
            "init_s": t_init + pre.get("seconds", 0.0), "init_bytes": pre.get("bytes_up", 0) + pre.get("bytes_down", 0),
            "seconds": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    lines = ["| dataset | method (init) | seed | rounds | ARI | accuracy | clusters found | clients per cluster | init s | "
             "run s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {METHOD[r['init']]} ({r['init']}) | {r['seed']} | {r['rounds']} | {r['ari']:.3f} | "
                     f"{r['accuracy']:.3f} | {r['clusters']} | {'/'.join(map(str, sorted(r['sizes'], reverse=True)))} | "
                     f"{r['init_s']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    lines = ["| dataset | method (init) | seeds with ARI ≥ 0.95 | mean ARI | mean accuracy | min accuracy |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["dataset"], r["init"]) for r in rows}, key=lambda k: (k[0], INITS.index(k[1]) if k[1] in INITS else 9))
    for ds, init in keys:
        rs = [r for r in rows if r["dataset"] == ds and r["init"] == init]
        good = sum(r["ari"] >= 0.95 for r in rs)
        lines.append(f"| {ds} | {METHOD[init]} ({init}) | {good}/{len(rs)} | {sum(r['ari'] for r in rs) / len(rs):.3f} | "
                     f"{sum(r['accuracy'] for r in rs) / len(rs):.3f} | {min(r['accuracy'] for r in rs):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["digits"], choices=["digits", "fmnist"])
    ap.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--fmnist-rounds", type=int, default=150)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override, key=value")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flockfl-ifca-init-") as parts:
        for ds in args.datasets:
            for init in args.inits:
                for seed in args.seeds:
                    r = run_one(ds, init, seed, args.fmnist_rounds, args.extra, parts)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    print()
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
