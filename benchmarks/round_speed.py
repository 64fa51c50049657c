"""Seconds per round on workload W1, flockfl against a plain sequential PyTorch loop.

W1: FedAvg, MLP 784-200-10, 1200 clients × 50 samples (synthetic inputs), 120 clients per
round, 1 local epoch, batch 10, lr 0.05.

Rows (each measured in its own child process, so peak RSS is per row):
- plain loop: per client ``deepcopy`` of the global model + ``torch.optim.SGD``, then a
  sample-weighted average of the state dicts;
- flockfl trainer: the vectorised cohort trainer alone on the same cohorts;
- flockfl rounds (no Prefect): select → train → aggregate → evaluate over all 1200 clients;
- ``flockfl run``: the real command end to end (Prefect ephemeral API, evaluation,
  checkpointing, MLflow logging), its ``round_s_median``.

Usage: python benchmarks/round_speed.py [--rounds 12] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import copy
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
N_CLIENTS, N_SAMPLES, COHORT, BATCH, LR = 1200, 50, 120, 10, 0.05


def make_npz(path: Path) -> None:
    """Synthetic W1 data: inputs ~ N(0, 1), labels from a random linear teacher."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((784, 10))
    n_tr, n_te = N_CLIENTS * N_SAMPLES, N_CLIENTS * 10
    x = rng.standard_normal((n_tr + n_te, 784)).astype(np.float32)
    y = (x @ teacher).argmax(1)
    np.savez(path, x_train=x[:n_tr], y_train=y[:n_tr], x_test=x[n_tr:], y_test=y[n_tr:],
             client_train=np.repeat(np.arange(N_CLIENTS), N_SAMPLES), client_test=np.repeat(np.arange(N_CLIENTS), 10))


def w1_config(npz: Path, rounds: int, threads: int) -> dict:
    return {
        "name": "w1", "seed": 0,
        "dataset": {"name": "npz", "path": str(npz)},
        "partition": {"scheme": "natural", "num_clients": N_CLIENTS},
        "model": {"name": "mlp", "hidden": 200},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": COHORT, "local_epochs": 1, "batch_size": BATCH, "lr": LR,
                  "threads": threads, "engine": "auto"},
        "tracking": {"register_model": False},
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------- child modes


def child_plain(npz: Path, rounds: int, threads: int) -> dict:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    z = np.load(npz)
    x, y = torch.from_numpy(z["x_train"]), torch.from_numpy(z["y_train"])
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 10))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        clients = rng.choice(N_CLIENTS, COHORT, replace=False)
        states, sizes = [], []
        for c in clients:
            net = copy.deepcopy(model)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            xc, yc = x[c * N_SAMPLES:(c + 1) * N_SAMPLES], y[c * N_SAMPLES:(c + 1) * N_SAMPLES]
            perm = torch.from_numpy(rng.permutation(N_SAMPLES))
            for b in range(0, N_SAMPLES, BATCH):
                idx = perm[b:b + BATCH]
                opt.zero_grad()
                nn.functional.cross_entropy(net(xc[idx]), yc[idx]).backward()
                opt.step()
            states.append(net.state_dict())
            sizes.append(N_SAMPLES)
        w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        model.load_state_dict({k: torch.tensordot(w, torch.stack([s[k] for s in states]), dims=1) for k in states[0]})
        times.append(time.perf_counter() - t0)
    return {"round_s": float(np.median(times[1:])), "peak_rss_mb": peak_rss_mb()}


def child_flockfl(npz: Path, rounds: int, threads: int) -> dict:
    from flockfl.experiments import validate
    from flockfl.engine import TRAINERS
    from flockfl.rounds import prepare, run_round

    cfg = validate(w1_config(npz, rounds, threads) | {"tracking": {"enabled": False}})
    with tempfile.TemporaryDirectory() as parts:
        prep = prepare(cfg, parts)
        state = prep.algorithm.init_state(prep.ctx)
        state.driver.engine = "vectorized"
        trainer, full = [], []
        for r in range(rounds):
            clients = prep.algorithm.select(state, prep.ctx, r)
            spec = prep.algorithm.local_spec(state, prep.ctx, clients, r)
            t0 = time.perf_counter()
            TRAINERS["vectorized"](prep.ctx.model, spec, prep.ctx.data.train, "classification", cfg.seed, r)
            trainer.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, _ = run_round(prep, state, r)
            full.append(time.perf_counter() - t0)
    return {"trainer_s": float(np.median(trainer[1:])), "rounds_s": float(np.median(full[1:])), "peak_rss_mb": peak_rss_mb()}


# ---------------------------------------------------------------------- parent


def run_child(mode: str, npz: Path, rounds: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--npz", str(npz), "--rounds", str(rounds),
                          "--threads", str(threads)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_flock(npz: Path, rounds: int, threads: int, work: Path) -> dict:
    import yaml

    cfg_path = work / f"w1-t{threads}.yaml"
    cfg_path.write_text(yaml.safe_dump(w1_config(npz, rounds, threads)))
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(cfg_path), "--run-dir", str(work / f"run-t{threads}"),
                           "--json", "--no-progress", "--partitions", str(work / "parts"),
                           "--tracking-uri", f"sqlite:///{work}/mlflow.db"],
                          capture_output=True, text=True, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"flockfl run failed: {proc.stderr.strip().splitlines()[-1]}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"round_s": s["round_s_median"], "compute_s": s["compute_round_s_median"], "engine": s["engine"],
            "orchestration_ms": s["orchestration_ms_median"],
            "process_s": time.perf_counter() - t0, "flow_s": s["wall_s"],
            "peak_rss_mb": max(rss, before) / 1024, "accuracy": s["metrics"]["accuracy"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--child")
    ap.add_argument("--npz")
    args = ap.parse_args()
    if args.child:
        fn = {"plain": child_plain, "flockfl": child_flockfl}[args.child]
        print(json.dumps(fn(Path(args.npz), args.rounds, args.threads[0])))
        return
    sys.path.insert(0, str(ROOT))
    from flows.env import configure_environment

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["PREFECT_HOME"] = str(work / ".prefect")
        configure_environment(home=work / ".prefect")
        npz = work / "w1.npz"
        make_npz(npz)
        print(f"W1: FedAvg, MLP 784-200-10, {N_CLIENTS} clients x {N_SAMPLES} samples, {COHORT} per round, "
              f"1 epoch, batch {BATCH}; median of {args.rounds - 1} rounds (first left out); cores: {os.cpu_count()}")
        print()
        print("| threads | plain loop s/round | flockfl trainer s/round | flockfl rounds (no Prefect) s/round | "
              "flockfl run s/round | speed-up plain / flockfl run | peak RSS plain / flockfl / flockfl run (MB) |")
        print("|---|---|---|---|---|---|---|")
        extra = []
        for t in args.threads:
            plain = run_child("plain", npz, args.rounds, t)
            fl = run_child("flockfl", npz, args.rounds, t)
            e2e = run_flock(npz, args.rounds, t, work)
            print(f"| {t} | {plain['round_s']:.3f} | {fl['trainer_s']:.3f} | {fl['rounds_s']:.3f} | {e2e['round_s']:.3f} | "
                  f"{plain['round_s'] / e2e['round_s']:.2f}x | {plain['peak_rss_mb']:.0f} / {fl['peak_rss_mb']:.0f} / "
                  f"{e2e['peak_rss_mb']:.0f} |", flush=True)
            extra.append((t, e2e))
        print()
        for t, e in extra:
            print(f"threads={t}: flockfl run engine={e['engine']}, process {e['process_s']:.1f}s, flow {e['flow_s']:.1f}s, "
                  f"Prefect overhead (round wall minus time inside task bodies) {e['orchestration_ms']:.1f} ms/round; "
                  f"final accuracy {e['accuracy']:.3f}")


if __name__ == "__main__":
    main()
