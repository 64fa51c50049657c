"""Seconds per round and peak memory as the population and the cohort grow.

Rows: populations of 1k, 10k and 100k clients × cohorts of 100, 1k and 10k (a cohort never
exceeds its population), for SCAFFOLD (one control variate c_i per client, kept in a
``ClientTable``) and FedAvg (no per-client state). Each row runs in its own child process (so
peak RSS is that row's) through the same driver as ``flock run`` without Prefect: select → train
→ aggregate → evaluate every federating client (in chunks of ``train.eval_chunk``), then an
atomic checkpoint of the state with its per-client rows, every round.

Data (synthetic, nothing downloaded): every client holds 10 training and 5 test samples of 60
features, labels from a random linear teacher; MLP 60-200-10 (14,210 parameters, so a dense
c_i table would take N × 56.8 KB: 5.7 GB at 100k clients). ``--fmnist`` adds the case the issue
measured before this change: SCAFFOLD on Fashion-MNIST, 10,000 clients, MLP 784-200-10, 1,000
per round (then: 20.9 GB peak RSS, 6.4 GB written per checkpoint).

Columns: s/round (median of the rounds after the first), peak RSS, bytes the round's
checkpoint wrote (checkpoint file + new per-client rows), the run directory's size at the end,
and what a dense [N, P] c_i would weigh. Growth lines compare each 10× step.

Usage: python benchmarks/scale.py [--rounds 3] [--populations 1000 10000 100000]
       [--cohorts 100 1000 10000] [--algorithms scaffold fedavg] [--fmnist] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRAIN, TEST, DIM = 10, 5, 60


def make_npz(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((DIM, 10)).astype(np.float32)
    x = rng.standard_normal((n * (TRAIN + TEST), DIM), dtype=np.float32)
    y = (x @ teacher).argmax(1)
    tr = n * TRAIN
    np.savez(path, x_train=x[:tr], y_train=y[:tr], x_test=x[tr:], y_test=y[tr:],
             client_train=np.repeat(np.arange(n), TRAIN), client_test=np.repeat(np.arange(n), TEST))


def config(algorithm: str, population: int, cohort: int, rounds: int, threads: int, npz: Path | None) -> dict:
    data = ({"dataset": {"name": "npz", "path": str(npz)}, "partition": {"scheme": "natural", "num_clients": population},
             "model": {"name": "mlp", "hidden": 200}} if npz else
            {"dataset": {"name": "fashion_mnist"}, "partition": {"scheme": "iid", "num_clients": population},
             "model": {"name": "mlp", "hidden": 200}})
    return {"name": f"scale-{algorithm}-{population}-{cohort}", "seed": 0, **data, "algorithm": {"name": algorithm},
            "train": {"rounds": rounds, "clients_per_round": cohort, "local_epochs": 1, "batch_size": 10, "lr": 0.05,
                      "threads": threads, "engine": "vectorized", "eval_finetune": "off"},
            "tracking": {"enabled": False}}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def child(algorithm: str, population: int, cohort: int, rounds: int, threads: int, fmnist: bool) -> dict:
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds
    from flockfl.state import save_checkpoint

    with tempfile.TemporaryDirectory(dir=os.environ.get("FLOCKFL_SCALE_TMP")) as tmp:
        tmp = Path(tmp)
        npz = None
        if not fmnist:
            npz = tmp / "data.npz"
            make_npz(npz, population)
        t0 = time.perf_counter()
        prep = prepare(validate(config(algorithm, population, cohort, rounds, threads, npz)), tmp / "partitions")
        setup_s = time.perf_counter() - t0
        run = tmp / "run"
        times, written = [], []
        clock, seen = [time.perf_counter()], [set()]

        def after(state, row):
            save_checkpoint(state, run, keep=3)
            ckpt = sorted((run / "checkpoints").glob("*.pt"))[-1].stat().st_size
            files = set((run / "client_state").rglob("*.row")) if (run / "client_state").exists() else set()
            written.append(ckpt + sum(f.stat().st_size for f in files - seen[0]))  # the rows this round wrote
            seen[0] = files
            now = time.perf_counter()
            times.append(now - clock[0])
            clock[0] = now

        state = run_rounds(prep, on_round=after)
        params = sum(v[0].numel() for v in state.models.values())
        return {"algorithm": algorithm, "population": population, "cohort": cohort, "setup_s": setup_s,
                "round_s": float(np.median(times[1:] or times)), "first_round_s": times[0],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "ckpt_written_mb": float(np.median(written[1:] or written)) / 2**20,
                "run_dir_mb": dir_bytes(run) / 2**20, "dense_ci_mb": population * params * 4 / 2**20,
                "accuracy": state.history[-1].get("accuracy"), "data": "fashion_mnist" if fmnist else "synthetic"}


def growth(rows: list[dict], key: str, along: str, fixed: str) -> list[str]:
    out = []
    for r in rows:
        for s in rows:
            if (s["algorithm"] == r["algorithm"] and s[fixed] == r[fixed] and s["data"] == r["data"]
                    and s[along] == 10 * r[along]):
                out.append(f"  {r['algorithm']:<8} {fixed}={r[fixed]:>6}: {along} {r[along]:>6} → {s[along]:>6}: "
                           f"{key} ×{s[key] / max(r[key], 1e-9):.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--populations", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--algorithms", nargs="+", default=["scaffold", "fedavg"])
    ap.add_argument("--fmnist", action="store_true", help="add SCAFFOLD on Fashion-MNIST, 10k clients, 1k per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        alg, pop, coh, rounds, threads, fm = args.child
        print(json.dumps(child(alg, int(pop), int(coh), int(rounds), int(threads), fm == "1")))
        return
    jobs = [(a, p, c, False) for a in args.algorithms for p in args.populations for c in args.cohorts if c <= p]
    if args.fmnist:
        jobs.append(("scaffold", 10000, 1000, True))
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    for alg, pop, coh, fm in jobs:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", alg, str(pop), str(coh), str(args.rounds),
                              str(args.threads), "1" if fm else "0"], capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode:
            print(f"{alg} {pop}/{coh}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"done {alg} {pop}/{coh} ({row['data']}) in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    head = (f"{'algorithm':<9} {'data':<13} {'population':>10} {'cohort':>6} {'s/round':>8} {'peak RSS MB':>11} "
            f"{'ckpt MB/round':>13} {'run dir MB':>10} {'dense c_i MB':>12} {'accuracy':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if r["accuracy"] is not None else "-"
        dense = f"{r['dense_ci_mb']:.0f}" if r["algorithm"] == "scaffold" else "-"
        print(f"{r['algorithm']:<9} {r['data']:<13} {r['population']:>10} {r['cohort']:>6} {r['round_s']:>8.2f} "
              f"{r['peak_rss_mb']:>11.0f} {r['ckpt_written_mb']:>13.1f} {r['run_dir_mb']:>10.1f} {dense:>12} {acc:>8}")
    synth = [r for r in rows if r["data"] == "synthetic"]
    for key in ("round_s", "peak_rss_mb"):
        print(f"\ngrowth of {key}, 10× population (same cohort):")
        print("\n".join(growth(synth, key, "population", "cohort")) or "  (no pairs)")
        print(f"growth of {key}, 10× cohort (same population):")
        print("\n".join(growth(synth, key, "cohort", "population")) or "  (no pairs)")


if __name__ == "__main__":
    main()
