"""Client updates per second on a GPU (or the CPU), for both trainers.

Workloads (FedAvg, 1 local epoch, batch 10, 50 samples per client, lr 0.05, synthetic data):

- W1: MLP 784-200-10, 1200 clients, 120 per round (as benchmarks/round_speed.py);
- W1-all: W1 with the whole population (1200 clients) as one cohort;
- LeNet-5: 1×28×28 inputs, 1000 clients, all 1000 per round.

Each row times the training stage of a round (``flockfl.rounds.train_stage``: shards of
``train.shard_size`` clients, the finite check) for one trainer, with
``torch.cuda.synchronize()`` around it; the first round warms up (vmap tracing, cuDNN) and
is left out; the table gives the median over ``--repeats`` rounds. ``--flock-run`` adds W1
through the real ``flockfl run`` (Prefect ephemeral API, evaluation, checkpoints), its
``round_s_median``.

Numerics follow ``train.fast_math`` (default false: deterministic kernels, no TF32);
``--fast-math`` measures TF32 and nondeterministic kernels instead.

Usage: python benchmarks/gpu_speed.py [--device cuda] [--repeats 5] [--fast-math] [--flock-run]
       python benchmarks/gpu_speed.py --device cpu --quick     (small sizes, runs anywhere)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, BATCH, LR = 50, 10, 0.05


def workloads(quick: bool) -> list[dict]:
    """(name, model, input shape, population, clients per round); --quick shrinks the populations."""
    s = 10 if quick else 1
    return [
        {"name": "W1", "model": "mlp", "shape": (784,), "clients": 1200 // s, "cohort": 120 // s},
        {"name": "W1-all", "model": "mlp", "shape": (784,), "clients": 1200 // s, "cohort": 1200 // s},
        {"name": "LeNet-5", "model": "lenet5", "shape": (1, 28, 28), "clients": 1000 // s, "cohort": 1000 // s},
    ]


def make_npz(path: Path, shape: tuple[int, ...], clients: int) -> None:
    """Inputs ~ N(0, 1), labels from a random linear teacher, ``SAMPLES`` per client (10 test)."""
    rng = np.random.default_rng(0)
    dim = int(np.prod(shape))
    teacher = rng.standard_normal((dim, 10)).astype(np.float32)
    n_tr, n_te = clients * SAMPLES, clients * 10
    x = rng.standard_normal((n_tr + n_te, dim)).astype(np.float32)
    y = (x @ teacher).argmax(1)
    x = x.reshape(-1, *shape)
    np.savez(path, x_train=x[:n_tr], y_train=y[:n_tr], x_test=x[n_tr:], y_test=y[n_tr:],
             client_train=np.repeat(np.arange(clients), SAMPLES), client_test=np.repeat(np.arange(clients), 10))


def config(w: dict, npz: Path, device: str, fast_math: bool, rounds: int, shard_size: int, threads: int) -> dict:
    return {
        "name": f"gpu-{w['name'].lower()}", "seed": 0,
        "dataset": {"name": "npz", "path": str(npz)},
        "partition": {"scheme": "natural", "num_clients": w["clients"]},
        "model": {"name": w["model"], "hidden": 200},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": w["cohort"], "local_epochs": 1, "batch_size": BATCH, "lr": LR,
                  "engine": "vectorized", "device": device, "fast_math": fast_math, "shard_size": shard_size,
                  "eval_finetune": "off", "threads": threads},
        "tracking": {"enabled": False},
    }


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_trainer(w: dict, npz: Path, engine: str, args, parts: Path) -> dict:
    """Median seconds of a round's training stage (after one warm-up round)."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, train_stage

    cfg = validate(config(w, npz, args.device, args.fast_math, args.repeats + 1, args.shard_size, args.threads))
    prep = prepare(cfg, parts)
    state = prep.algorithm.init_state(prep.ctx)
    device = prep.ctx.data.train.x.device
    times = []
    for r in range(args.repeats + 1):
        clients = prep.algorithm.select(state, prep.ctx, r)
        spec = prep.algorithm.local_spec(state, prep.ctx, clients, r)
        sync(device)
        t0 = time.perf_counter()
        result, dropped = train_stage(prep, spec, engine, r)
        sync(device)
        times.append(time.perf_counter() - t0)
        if dropped or result is None:
            raise SystemExit(f"{w['name']} / {engine}: clients {dropped} failed to train")
    s = float(np.median(times[1:]))
    return {"round_s": s, "updates_per_s": len(clients) / s, "cohort": len(clients), "device": str(device)}


def flock_run_w1(w: dict, npz: Path, args, work: Path) -> dict:
    import yaml

    path = work / "w1-flock.yaml"
    cfg = config(w, npz, args.device, args.fast_math, args.repeats + 1, args.shard_size, args.threads)
    cfg["train"]["eval_finetune"] = "final"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path), "--run-dir", str(work / "run-w1"), "--json",
                           "--no-progress", "--partitions", str(work / "parts")],
                          capture_output=True, text=True, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"flockfl run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"round_s": s["round_s_median"], "updates_per_s": w["cohort"] / s["round_s_median"]}


def pick_device(name: str) -> str:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        print("gpu_speed: no CUDA device here (torch.cuda.is_available() is False); measuring on the CPU instead "
              "(use --device cpu --quick for a short run)", file=sys.stderr)
        return "cpu"
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=5, help="rounds timed after one warm-up round (median)")
    ap.add_argument("--quick", action="store_true", help="populations / 10 (W1: 12 per round; LeNet-5: 100 clients)")
    ap.add_argument("--fast-math", action="store_true", help="train.fast_math=true: TF32, nondeterministic kernels")
    ap.add_argument("--shard-size", type=int, default=256, help="train.shard_size: clients per vectorised call")
    ap.add_argument("--threads", type=int, default=0, help="train.threads: torch CPU threads (0: the cores, at most 4)")
    ap.add_argument("--flock-run", action="store_true", help="also W1 through `flockfl run` (Prefect, evaluation, checkpoints)")
    ap.add_argument("--engines", nargs="+", default=["vectorized", "reference"], choices=("vectorized", "reference"))
    ap.add_argument("--only", nargs="+", help="workload names to run (W1, W1-all, LeNet-5)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from flows.env import configure_environment

    import torch

    from flockfl.engine import configure_threads

    args.device = pick_device(args.device)
    args.threads = configure_threads(args.threads)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    where += f" ({args.threads} CPU threads)"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["PREFECT_HOME"] = str(work / ".prefect")
        configure_environment(home=work / ".prefect")
        print(f"device: {where}; torch {torch.__version__}; fast_math={args.fast_math}; shard_size={args.shard_size}; "
              f"median of {args.repeats} rounds after 1 warm-up; FedAvg, 1 epoch, batch {BATCH}, {SAMPLES} samples per client")
        print()
        print("| workload | model | clients/round | trainer | s/round | client updates/s |")
        print("|---|---|---|---|---|---|")
        for w in workloads(args.quick):
            if args.only and w["name"] not in args.only:
                continue
            npz = work / f"{w['name']}.npz"
            make_npz(npz, w["shape"], w["clients"])
            for engine in args.engines:
                r = time_trainer(w, npz, engine, args, work / "parts")
                print(f"| {w['name']} | {w['model']} {'x'.join(map(str, w['shape']))} | {r['cohort']} | {engine} | "
                      f"{r['round_s']:.4f} | {r['updates_per_s']:,.0f} |", flush=True)
            if args.flock_run and w["name"] == "W1":
                r = flock_run_w1(w, npz, args, work)
                print(f"| W1 | mlp 784 | {w['cohort']} | `flockfl run` round (Prefect, evaluation, checkpoint) | "
                      f"{r['round_s']:.4f} | {r['updates_per_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
