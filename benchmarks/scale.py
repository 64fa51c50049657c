"""Seconds per round and peak memory as the population and the cohort grow, up to 1,000,000 clients.

Rows: populations of 1k, 10k and 100k clients × cohorts of 100, 1k and 10k (a cohort never
exceeds its population), for SCAFFOLD (one control variate c_i per client, kept in a
``ClientTable``) and FedAvg (no per-client state). Each row runs in its own child process (so
peak RSS is that row's) through the same driver as ``flockfl run`` without Prefect: select → train
→ aggregate → evaluate every federating client (in chunks of ``train.eval_chunk``; every
``--eval-every`` rounds), then an atomic checkpoint of the state with its per-client rows, every
round. The 1M table (issue 22): ``--populations 10000 100000 1000000 --cohorts 1000``.

Data (synthetic, nothing downloaded): every client holds 10 training and 5 test samples of 60
features, labels from a random linear teacher; MLP 60-200-10 (14,210 parameters, so a dense
c_i table would take N × 56.8 KB: 5.7 GB at 100k clients). The npz is written client by client
(natural clients, ``partition.scheme=natural``), in blocks, so making it never holds more than
a block. ``--fmnist`` adds the case the issue measured before the ClientTable: SCAFFOLD on
Fashion-MNIST, 10,000 clients, MLP 784-200-10, 1,000 per round (then: 20.9 GB peak RSS,
6.4 GB written per checkpoint).

Columns: s/round (median of the rounds after the first) and its parts (select, train,
aggregate, evaluate, checkpoint), the set-up (making the data, loading it and building the
partition), peak RSS, the bytes that scale with the population (the data itself, the
partition's per-client arrays, the per-client bookkeeping: assignments and their history, the
ClientTable's digests), bytes the round's checkpoint wrote (checkpoint file + new per-client
rows), the run directory's size at the end, and what a dense [N, P] c_i would weigh. Growth
lines compare each 10× step.

Usage: python benchmarks/scale.py [--rounds 3] [--populations 1000 10000 100000]
       [--cohorts 100 1000 10000] [--algorithms scaffold fedavg] [--eval-every 1] [--fmnist]
       [--threads 2] [--conventions cheap|all|configured] [--json FILE]
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


BLOCK = 50_000  # clients generated at a time


def make_npz(path: Path, n: int) -> None:
    """The synthetic population as an uncompressed npz, written array by array and block by block
    (np.savez would first hold every array in memory: 3.6 GB at 1M clients)."""
    import zipfile

    from numpy.lib import format as npformat

    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((DIM, 10)).astype(np.float32)
    arrays = {"x_train": ((n * TRAIN, DIM), np.float32), "y_train": ((n * TRAIN,), np.int64),
              "x_test": ((n * TEST, DIM), np.float32), "y_test": ((n * TEST,), np.int64),
              "client_train": ((n * TRAIN,), np.int64), "client_test": ((n * TEST,), np.int64)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, (shape, dtype) in arrays.items():
            per = TRAIN if "train" in name else TEST
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                npformat.write_array_header_1_0(f, {"descr": npformat.dtype_to_descr(np.dtype(dtype)),
                                                    "fortran_order": False, "shape": shape})
                for a in range(0, n, BLOCK):
                    b = min(n, a + BLOCK)
                    if name.startswith("client"):
                        block = np.repeat(np.arange(a, b), per)
                    else:  # the same stream whichever array asks: block a's samples from (a, split)
                        g = np.random.default_rng([0, a, per])
                        x = g.standard_normal(((b - a) * per, DIM), dtype=np.float32)
                        block = x if name.startswith("x") else (x @ teacher).argmax(1)
                    f.write(np.ascontiguousarray(block, dtype).tobytes())


def config(algorithm: str, population: int, cohort: int, rounds: int, threads: int, npz: Path | None,
           eval_every: int = 1) -> dict:
    data = ({"dataset": {"name": "npz", "path": str(npz)}, "partition": {"scheme": "natural", "num_clients": population},
             "model": {"name": "mlp", "hidden": 200}} if npz else
            {"dataset": {"name": "fashion_mnist"}, "partition": {"scheme": "iid", "num_clients": population},
             "model": {"name": "mlp", "hidden": 200}})
    return {"name": f"scale-{algorithm}-{population}-{cohort}", "seed": 0, **data, "algorithm": {"name": algorithm},
            "train": {"rounds": rounds, "clients_per_round": cohort, "local_epochs": 1, "batch_size": 10, "lr": 0.05,
                      "threads": threads, "engine": "vectorized", "eval_finetune": "off", "eval_every": eval_every},
            # --conventions (FLOCKFL_SCALE_CONVENTIONS for a --child; default flockfl's own, cheap)
            "eval": {"conventions": os.environ.get("FLOCKFL_SCALE_CONVENTIONS", "cheap")},
            "tracking": {"enabled": False}}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def population_bytes(prep, state) -> dict[str, int]:
    """What the run holds per client (each grows with the population)."""
    from flockfl.clientstate import tables

    d = prep.ctx.data
    hist = np.asarray(state.assignment_history)
    return {"data": sum(t.numel() * t.element_size() for s in (d.train, d.test) for t in (s.x, s.y)),
            "partition": sum(np.asarray(a).nbytes for a in (d.train.offsets, d.test.offsets, d.group)),
            "assignments": np.asarray(state.assignments).nbytes + hist.nbytes,
            "client_table": sum(t.digests.nbytes + t.has.nbytes for _, t in tables(state.algo))}


def child(algorithm: str, population: int, cohort: int, rounds: int, threads: int, fmnist: bool,
          eval_every: int = 1) -> dict:
    from flockfl import rounds as R
    from flockfl.experiments import validate
    from flockfl.state import save_checkpoint

    with tempfile.TemporaryDirectory(dir=os.environ.get("FLOCKFL_SCALE_TMP")) as tmp:
        tmp = Path(tmp)
        npz = None
        t0 = time.perf_counter()
        if not fmnist:
            npz = tmp / "data.npz"
            make_npz(npz, population)
        data_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        prep = R.prepare(validate(config(algorithm, population, cohort, rounds, threads, npz, eval_every)), tmp / "partitions")
        setup_s = time.perf_counter() - t0
        rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        run = tmp / "run"
        times, written = [], []
        parts: dict[str, list[float]] = {}
        acc = {}  # this round's seconds per stage
        clock, seen = [time.perf_counter()], [set()]

        def timed(name, fn):
            def call(*args):
                t = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return call

        stages = R.Stages(select=timed("select", R.select_stage), train=timed("train", R.train_stage),
                          cluster=timed("aggregate", R.cluster_stage), aggregate=timed("aggregate", R.aggregate_stage),
                          evaluate=timed("evaluate", R.evaluate_stage))

        def after(state, row):
            t = time.perf_counter()
            save_checkpoint(state, run, keep=3)
            acc["checkpoint"] = time.perf_counter() - t
            ckpt = sorted((run / "checkpoints").glob("*.pt"))[-1].stat().st_size
            files = set((run / "client_state").rglob("*.row")) if (run / "client_state").exists() else set()
            written.append(ckpt + sum(f.stat().st_size for f in files - seen[0]))  # the rows this round wrote
            seen[0] = files
            now = time.perf_counter()
            times.append(now - clock[0])
            for k in ("select", "train", "aggregate", "evaluate", "checkpoint"):
                parts.setdefault(k, []).append(acc.get(k, 0.0))
            acc.clear()
            clock[0] = time.perf_counter()

        state = R.drive(prep, None, stages, on_round=after)
        params = sum(v[0].numel() for v in state.models.values())
        # the rounds that did not evaluate (eval_every > 1) against all rounds after the first
        plain = [t - e for t, e in zip(times, parts["evaluate"])]
        evals = [e for e in parts["evaluate"][1:] if e > 0] or [e for e in parts["evaluate"] if e > 0]
        return {"algorithm": algorithm, "population": population, "cohort": cohort, "setup_s": setup_s, "data_s": data_s,
                "round_s": float(np.median(times[1:] or times)), "first_round_s": times[0],
                "round_wo_eval_s": float(np.median(plain[1:] or plain)),
                "eval_s": float(np.median(evals)) if evals else float("nan"),
                **{f"{k}_s": float(np.median(v[1:] or v)) for k, v in parts.items() if k != "evaluate"},
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "setup_rss_mb": rss_setup,
                **{f"{k}_mb": v / 2**20 for k, v in population_bytes(prep, state).items()},
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
    ap.add_argument("--eval-every", type=int, default=1, help="evaluate every federating client every N rounds (and last)")
    ap.add_argument("--conventions", default="cheap", choices=["cheap", "all", "configured"],
                    help="eval.conventions (flockfl's default: cheap); configured measures only the proportional test set")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        alg, pop, coh, rounds, threads, fm, every = args.child
        print(json.dumps(child(alg, int(pop), int(coh), int(rounds), int(threads), fm == "1", int(every))))
        return
    jobs = [(a, p, c, False) for a in args.algorithms for p in args.populations for c in args.cohorts if c <= p]
    if args.fmnist:
        jobs.append(("scaffold", 10000, 1000, True))
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT),
           "FLOCKFL_SCALE_CONVENTIONS": args.conventions}
    for alg, pop, coh, fm in jobs:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", alg, str(pop), str(coh), str(args.rounds),
                              str(args.threads), "1" if fm else "0", str(args.eval_every)],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode:
            print(f"{alg} {pop}/{coh}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"done {alg} {pop}/{coh} ({row['data']}) in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    cols = [("algorithm", "algorithm", "<9", "s"), ("data", "data", "<13", "s"), ("population", "population", ">10", "d"),
            ("cohort", "cohort", ">6", "d"), ("s/round", "round_s", ">8", ".2f"), ("w/o eval", "round_wo_eval_s", ">8", ".2f"),
            ("select", "select_s", ">6", ".3f"), ("train", "train_s", ">6", ".2f"), ("aggr", "aggregate_s", ">6", ".2f"),
            ("eval", "eval_s", ">6", ".2f"), ("ckpt", "checkpoint_s", ">6", ".2f"), ("setup s", "setup_s", ">7", ".1f"),
            ("peak RSS MB", "peak_rss_mb", ">11", ".0f"), ("data MB", "data_mb", ">8", ".0f"),
            ("partition MB", "partition_mb", ">12", ".1f"), ("assign MB", "assignments_mb", ">9", ".1f"),
            ("table MB", "client_table_mb", ">8", ".1f"), ("ckpt MB/round", "ckpt_written_mb", ">13", ".1f"),
            ("run dir MB", "run_dir_mb", ">10", ".1f"), ("dense c_i MB", "dense_ci_mb", ">12", ".0f"),
            ("accuracy", "accuracy", ">8", ".3f")]
    head = " ".join(format(h, w) for h, _, w, _ in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for _, key, w, f in cols:
            v = r.get(key)
            if key == "dense_ci_mb" and r["algorithm"] != "scaffold" or v is None or (isinstance(v, float) and v != v):
                cells.append(format("-", w))
            else:
                cells.append(format(v, w + (f if f != "s" else "")))
        print(" ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    synth = [r for r in rows if r["data"] == "synthetic"]
    for key in ("round_s", "round_wo_eval_s", "peak_rss_mb"):
        print(f"\ngrowth of {key}, 10× population (same cohort):")
        print("\n".join(growth(synth, key, "population", "cohort")) or "  (no pairs)")
        print(f"growth of {key}, 10× cohort (same population):")
        print("\n".join(growth(synth, key, "cohort", "population")) or "  (no pairs)")


if __name__ == "__main__":
    main()
