"""Seconds per round, flockfl against the plain per-client PyTorch loop a researcher writes,
measured side by side in one process: training one round, and one full evaluation of every client.

Workloads (FedAvg):

- ``w1``: W1 of ``round_speed.py``: MLP 784-200-10, 1200 synthetic clients × 50 samples, 120
  per round, 1 local epoch, batch 10, lr 0.05; every client's 10 test samples evaluated.
- ``lenet5``: LeNet-5 on Fashion-MNIST, 100 clients × 2 shards of 250 images, 10 per round,
  2 local epochs, batch 10, lr 0.01; every client's test split evaluated.
- ``cnn_bn``: the thesis's 2-conv CNN with BatchNorm on the same partition.

flockfl: ``train.engine=auto`` (the choice and its probe are printed), each round driven by
``flockfl.rounds.drive_round`` with the training stage (``train_stage``) and the evaluation
(``evaluate_stage``, ``eval.test_set=proportional``) timed. The plain loop, in the same round,
on the same cohort and data: per client ``copy.deepcopy`` of its global model,
``torch.optim.SGD``, a fresh permutation per epoch, ``cross_entropy`` and ``backward``; its
FedAvg average of the state dicts is not timed. Its evaluation: ``model.eval()`` and, for every
client, a forward pass over its test split, cross-entropy and accuracy. Its BN model uses
``nn.BatchNorm2d``. Both start from flockfl's initial global model. The first round of each
(warm-up, and the auto engine's probe) is left out; the table gives medians, and
``ratio = plain ÷ flockfl`` (above 1: flockfl is faster).

``NAME:K`` runs a workload with K clients per round (``cnn_bn:50``).

Threads: ``--threads 0`` is flockfl's default (the cores, at most 4: 2 here). On this shared
2-core machine, with another process busy, two threads made every small op wait for the
descheduled one (W1's plain loop 57 s a round at 2 threads, 0.34 s at 1); when the machine is
quieter two threads are faster. Compare rows of one run only, and give ``--threads`` to pin it.
The thread count changes the bits of some reductions (the digest corpus fails at 1 thread), so
flockfl's default is not chosen by load; ``train.threads`` sets it.
``--conv-layout`` sets ``train.conv_layout`` (default ``auto``: the vectorised convolutions
channels-last on a CPU; ``contiguous``: NCHW, vmap's bits; see
``flockfl.engine.functional.memory_format``).

Through ``flockfl run`` (``--runs fedavg,fedprox,scaffold``, W1 only): the whole round as the
command runs it with its defaults (evaluation every round, checkpoint, MLflow logging):
``round_s_median`` of ``flockfl run --json`` (a plain process, ``FLOCKFL_RESIDENT=off``: the
round is the same either way), beside the researcher's whole round: the loop's training (FedProx:
the proximal term in the loss; SCAFFOLD: option II control variates, kept per client, the
corrected gradient), its average, its evaluation of every client and ``torch.save`` of its state.
No low-rank shortcut is taken by FedProx or SCAFFOLD (their clients' weights differ from the
first step). Each algorithm runs ``--pairs`` times (default 3), each pair a ``flockfl run`` and
the loop right after it; the table gives every pair's ratio and their median: on this shared
machine the loop's own round moved 0.62 → 0.96 s between runs of the same script.

Usage: python benchmarks/speed_table.py [--workloads w1,lenet5,cnn_bn] [--rounds 5] [--threads 0]
                                        [--device cpu|cuda] [--engine auto] [--fmnist DIR]
                                        [--runs fedavg,fedprox,scaffold | --runs none] [--pairs 3]
                                        [--conv-layout auto|channels_last|contiguous]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FMNIST = "/usr/share/datasets/fashion-mnist"


def fmnist_config(model: str, path: str) -> dict:
    return {"name": f"speed-{model}", "seed": 0, "dataset": {"name": "fashion_mnist", "path": path},
            "model": {"name": model}, "algorithm": {"name": "fedavg"},
            "partition": {"scheme": "shards", "num_clients": 100, "classes_per_client": 2, "shard_size": 250},
            "train": {"clients_per_round": 10, "local_epochs": 2, "batch_size": 10, "lr": 0.01}}


def plain_model(name: str, input_shape: tuple, classes: int):
    """The model as a researcher writes it (plain torch modules, ``nn.BatchNorm2d``)."""
    from torch import nn

    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 200), nn.ReLU(), nn.Linear(200, classes))
    if name == "lenet5":
        return nn.Sequential(nn.Conv2d(input_shape[0], 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                             nn.Linear(84, classes))
    if name == "cnn_bn":
        return nn.Sequential(nn.Conv2d(input_shape[0], 10, 5), nn.BatchNorm2d(10), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(10, 20, 5), nn.BatchNorm2d(20), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(320, 50), nn.ReLU(), nn.Linear(50, classes))
    raise ValueError(name)


def load_init(net, params: dict) -> None:
    """flockfl's initial global model into the plain model: trained tensors in order (BN: γ, β),
    BN statistics by name."""
    import torch

    trained = [v for k, v in params.items() if not k.endswith(("running_mean", "running_var"))]
    with torch.no_grad():
        for p, v in zip(net.parameters(), trained, strict=True):
            p.copy_(v.reshape(p.shape))


class Plain:
    """The researcher's FedAvg: per-client copies trained with torch.optim.SGD."""

    def __init__(self, net, data, cfg, device):
        self.net, self.data, self.t, self.device = net.to(device), data, cfg.train, device

    def train(self, clients, round: int) -> list[dict]:
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(round)
        states = []
        for c in clients:
            x, y = self.data.train.client(int(c))
            net = copy.deepcopy(self.net)
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=self.t.lr)
            for _ in range(self.t.local_epochs):
                perm = torch.randperm(len(y), generator=g).to(self.device)
                for a in range(0, len(y), self.t.batch_size):
                    idx = perm[a:a + self.t.batch_size]
                    opt.zero_grad()
                    nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
                    opt.step()
            states.append(net.state_dict())
        return states

    def average(self, states: list[dict], sizes: np.ndarray) -> None:
        import torch

        w = torch.tensor(sizes / sizes.sum(), dtype=torch.float32, device=self.device)
        avg = {k: (torch.tensordot(w, torch.stack([s[k] for s in states]).float(), dims=1) if v.is_floating_point() else v)
               for k, v in states[0].items()}
        self.net.load_state_dict(avg)

    def evaluate(self) -> float:
        import torch
        from torch import nn

        self.net.eval()
        hits = total = 0
        with torch.no_grad():
            for c in range(self.data.num_clients):
                x, y = self.data.test.client(c)
                out = self.net(x)
                nn.functional.cross_entropy(out, y)
                hits += int((out.argmax(1) == y).sum())
                total += len(y)
        return hits / max(total, 1)


class PlainRun(Plain):
    """The researcher's whole round: train (FedAvg, FedProx or SCAFFOLD), average, evaluate, save."""

    def __init__(self, net, data, cfg, device, algo: str, mu: float):
        super().__init__(net, data, cfg, device)
        self.algo, self.mu = algo, mu
        self.c = [p.detach().clone().zero_() for p in net.parameters()]  # SCAFFOLD: the server's c
        self.c_i: dict[int, list] = {}  # ... and each client's, zero until it first trains

    def train(self, clients, round: int) -> list[dict]:
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(round)
        anchor = [p.detach().clone() for p in self.net.parameters()]
        states, new_ci = [], {}
        for c in clients:
            c = int(c)
            x, y = self.data.train.client(c)
            net = copy.deepcopy(self.net)
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=self.t.lr)
            ci = self.c_i.get(c) or [torch.zeros_like(p) for p in anchor]
            steps = 0
            for _ in range(self.t.local_epochs):
                perm = torch.randperm(len(y), generator=g).to(self.device)
                for a in range(0, len(y), self.t.batch_size):
                    idx = perm[a:a + self.t.batch_size]
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
                    if self.algo == "fedprox":
                        loss = loss + self.mu / 2 * sum(((p - w) ** 2).sum() for p, w in zip(net.parameters(), anchor))
                    loss.backward()
                    if self.algo == "scaffold":
                        with torch.no_grad():
                            for p, cc, cic in zip(net.parameters(), self.c, ci):
                                p.grad += cc - cic
                    opt.step()
                    steps += 1
            if self.algo == "scaffold":  # option II
                with torch.no_grad():
                    new_ci[c] = [cic - cc + (w - p) / (steps * self.t.lr)
                                 for p, w, cc, cic in zip(net.parameters(), anchor, self.c, ci)]
            states.append(net.state_dict())
        if self.algo == "scaffold":
            with torch.no_grad():
                for j in range(len(self.c)):
                    dc = torch.stack([new_ci[c][j] - (self.c_i.get(c) or [torch.zeros_like(a) for a in anchor])[j]
                                      for c in new_ci]).mean(0)
                    self.c[j] += len(clients) / self.data.num_clients * dc
            self.c_i.update(new_ci)
        return states

    def round(self, clients, sizes, round: int, path: Path) -> None:
        import torch

        states = self.train(clients, round)
        # SCAFFOLD averages unweighted (the paper); FedAvg and FedProx by samples
        self.average(states, np.ones(len(states)) if self.algo == "scaffold" else sizes)
        self.evaluate()
        torch.save({"model": self.net.state_dict(), "c": self.c, "c_i": self.c_i}, path)


@contextlib.contextmanager
def _work_folder():
    """A temporary folder, removed when the block ends however it ends."""
    with tempfile.TemporaryDirectory(prefix="flockfl-speed-", ignore_cleanup_errors=True) as work:
        yield Path(work)


def run_rounds(algo: str, raw: dict, rounds: int, threads: int) -> dict:
    """:func:`_run_rounds` in a work folder removed afterwards (a W1 run leaves ~1.1 GB)."""
    with _work_folder() as work:
        return _run_rounds(algo, raw, rounds, threads, work)


def _run_rounds(algo: str, raw: dict, rounds: int, threads: int, work: Path) -> dict:
    """One algorithm on W1: the researcher's whole round, timed here, and ``flockfl run``'s own
    ``round_s_median`` (a subprocess, the defaults but for the algorithm and the threads)."""
    import json
    import subprocess

    import torch
    import yaml

    from flockfl.experiments import validate
    from flockfl.rounds import prepare

    raw = copy.deepcopy(raw)
    raw["algorithm"] = {"name": algo}
    raw["train"].update({"rounds": rounds, "threads": threads})
    raw["tracking"] = {"register_model": False}
    (work / "w1.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "FLOCKFL_RESIDENT": "off", "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(work / ".prefect")}
    env.pop("PREFECT_API_URL", None)
    res = subprocess.run([sys.executable, "-m", "flows.cli", "run", "w1.yaml", "--json", "--no-progress", "--tracking-uri",
                          f"sqlite:///{work}/mlflow.db", "--partitions", "parts", "--run-dir", "runs/w1"],
                         cwd=work, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"flockfl run ({algo}) failed:\n{res.stderr[-3000:]}")
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    cfg = validate({**raw, "tracking": {"enabled": False}})
    prep = prepare(cfg, work / "plain-parts")
    ctx = prep.ctx
    state = prep.algorithm.init_state(ctx)
    net = plain_model(cfg.model.name, ctx.data.input_shape, ctx.data.num_outputs)
    load_init(net, {k: v[0] for k, v in state.models.items()})
    mu = float(prep.algorithm.hp("mu")) if algo == "fedprox" else 0.0
    plain = PlainRun(net, ctx.data, cfg, ctx.data.train.x.device, algo, mu)
    rng = np.random.default_rng(0)
    times = []
    for r in range(rounds):
        clients = np.sort(rng.choice(ctx.num_clients, cfg.train.clients_per_round, replace=False))
        t0 = time.perf_counter()
        plain.round(clients, ctx.data.train.sizes[clients].astype(np.float64), r, work / "plain-ckpt.pt")
        times.append(time.perf_counter() - t0)
    return {"algo": algo, "plain_round": float(np.median(times[1:])), "flockfl_round": summary["round_s_median"],
            "engine": summary.get("engine"), "threads": torch.get_num_threads()}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_workload(name: str, raw: dict, rounds: int, args, cohort: int = 0) -> dict:
    """:func:`_run_workload` in a work folder removed afterwards."""
    with _work_folder() as work:
        return _run_workload(name, raw, rounds, args, cohort, work)


def _run_workload(name: str, raw: dict, rounds: int, args, cohort: int, work: Path) -> dict:
    from flockfl.experiments import validate
    from flockfl.rounds import PLAIN, drive_round, evaluate_stage, prepare, train_stage

    raw = copy.deepcopy(raw)
    # no fine-tuned convention: the loop evaluates the global model as it is, and so does flockfl
    raw["train"].update({"rounds": rounds, "threads": args.threads, "engine": args.engine, "device": args.device,
                         "eval_finetune": "off", "conv_layout": args.conv_layout})
    if cohort:
        raw["train"]["clients_per_round"] = cohort
    raw["tracking"] = {"enabled": False}
    cfg = validate(raw)
    prep = prepare(cfg, work / "parts")
    ctx, device = prep.ctx, prep.ctx.data.train.x.device
    state = prep.algorithm.init_state(ctx)
    plain = Plain(plain_model(cfg.model.name, ctx.data.input_shape, ctx.data.num_outputs), ctx.data, cfg, device)
    load_init(plain.net, {k: v[0] for k, v in state.models.items()})
    times: dict[str, list] = {"plain_train": [], "flockfl_train": [], "plain_eval": [], "flockfl_eval": []}
    acc = {}

    def timed_train(prep, spec, engine, round):
        sync(device)
        t0 = time.perf_counter()
        states = plain.train(spec.clients, round)
        sync(device)
        t1 = time.perf_counter()
        out = train_stage(prep, spec, engine, round)
        sync(device)
        t2 = time.perf_counter()
        times["plain_train"].append(t1 - t0)
        times["flockfl_train"].append(t2 - t1)
        plain.average(states, ctx.data.train.sizes[spec.clients].astype(np.float64))
        return out

    def timed_eval(prep, state, round):
        sync(device)
        t0 = time.perf_counter()
        acc["plain"] = plain.evaluate()
        sync(device)
        t1 = time.perf_counter()
        metrics = evaluate_stage(prep, state, round)
        sync(device)
        t2 = time.perf_counter()
        times["plain_eval"].append(t1 - t0)
        times["flockfl_eval"].append(t2 - t1)
        acc["flockfl"] = metrics["accuracy"]
        return metrics

    stages = dataclasses.replace(PLAIN, train=timed_train, evaluate=timed_eval)
    for r in range(rounds):
        state, _ = drive_round(prep, state, r, stages)
    med = {k: float(np.median(v[1:] if len(v) > 1 else v)) for k, v in times.items()}
    return {"workload": name, **med, "engine": state.driver.engine, "reason": state.driver.engine_reason or "",
            "acc_plain": acc["plain"], "acc_flockfl": acc["flockfl"], "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="w1,lenet5,cnn_bn")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per workload (the first is left out)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores, at most 4)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--engine", default="auto", choices=["auto", "vectorized", "reference"])
    ap.add_argument("--fmnist", default=FMNIST, help="directory of the Fashion-MNIST idx files")
    ap.add_argument("--runs", default="fedavg,fedprox,scaffold",
                    help="algorithms timed on W1 through `flockfl run`, whole rounds ('none': no such rows)")
    ap.add_argument("--run-rounds", type=int, default=10, help="rounds of each `flockfl run` and of its loop (median)")
    ap.add_argument("--pairs", type=int, default=3, help="(flockfl run, loop) pairs per algorithm (the median ratio)")
    ap.add_argument("--conv-layout", default="auto", choices=["auto", "channels_last", "contiguous"],
                    help="train.conv_layout")
    args = ap.parse_args()
    with _work_folder() as tmp:
        _tables(args, tmp)


def _tables(args, tmp: Path) -> None:
    import torch

    import round_speed

    rows = []
    for spec in args.workloads.split(","):
        name, _, cohort = spec.partition(":")
        if name == "w1":
            npz = tmp / "w1.npz"
            round_speed.make_npz(npz)
            raw = round_speed.w1_config(npz, args.rounds, args.threads)
        else:
            raw = fmnist_config(name, args.fmnist)
        rows.append(run_workload(spec, raw, args.rounds, args, int(cohort or 0)))
        r = rows[-1]
        print(f"# {spec}: engine={r['engine']} ({r['reason']}); final accuracy plain {r['acc_plain']:.3f}, "
              f"flockfl {r['acc_flockfl']:.3f}", flush=True)
    print()
    print(f"device={args.device} threads={torch.get_num_threads()} cores={os.cpu_count()} conv layout={args.conv_layout} "
          f"torch {torch.__version__}; "
          f"median of {args.rounds - 1} rounds (first left out); ratio = plain ÷ flockfl")
    print()
    print("| workload | engine | train: plain s | train: flockfl s | train ratio | eval: plain s | eval: flockfl s | "
          "eval ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['engine']} | {r['plain_train']:.3f} | {r['flockfl_train']:.3f} | "
              f"{r['plain_train'] / r['flockfl_train']:.2f}x | {r['plain_eval']:.3f} | {r['flockfl_eval']:.3f} | "
              f"{r['plain_eval'] / r['flockfl_eval']:.2f}x |")
    if args.runs == "none":
        return
    npz = tmp / "w1-run.npz"
    round_speed.make_npz(npz)
    raw = round_speed.w1_config(npz, args.rounds, args.threads)
    runs = []
    for algo in args.runs.split(","):
        pairs = []
        for i in range(args.pairs):
            pairs.append(run_rounds(algo, raw, args.run_rounds, args.threads))
            print(f"# W1 {algo} through flockfl run, pair {i + 1}/{args.pairs}: loop {pairs[-1]['plain_round']:.3f} s, "
                  f"flockfl {pairs[-1]['flockfl_round']:.3f} s", flush=True)
        runs.append(pairs)
    print()
    print("W1 through `flockfl run` (its defaults: evaluation every round, checkpoint, MLflow), the whole round; the loop's "
          "whole round: train, average, evaluate every client, torch.save")
    print()
    print(f"median of {args.run_rounds} rounds (the loop: the first left out); {args.pairs} pairs, each a `flockfl run` then "
          "its loop right after it: the ratio of each pair, and their median (the machine's speed drifts between pairs)\n")
    print("| W1 | engine | round: plain loop s (median of pairs) | round: flockfl run s (median of pairs) | ratio of each pair "
          "| median ratio |")
    print("|---|---|---|---|---|---|")
    for pairs in runs:
        ratios = [p["plain_round"] / p["flockfl_round"] for p in pairs]
        print(f"| {pairs[0]['algo']} | {pairs[0]['engine']} | {np.median([p['plain_round'] for p in pairs]):.3f} | "
              f"{np.median([p['flockfl_round'] for p in pairs]):.3f} | {' / '.join(f'{r:.2f}x' for r in ratios)} | "
              f"**{np.median(ratios):.2f}x** |")


if __name__ == "__main__":
    main()
