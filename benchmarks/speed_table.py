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

Usage: python benchmarks/speed_table.py [--workloads w1,lenet5,cnn_bn] [--rounds 5] [--threads 0]
                                        [--device cpu|cuda] [--engine auto] [--fmnist DIR]
                                        [--conv-layout auto|channels_last|contiguous]
"""

from __future__ import annotations

import argparse
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


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_workload(name: str, raw: dict, rounds: int, args, cohort: int = 0) -> dict:
    import torch

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
    work = Path(tempfile.mkdtemp())
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
    ap.add_argument("--conv-layout", default="auto", choices=["auto", "channels_last", "contiguous"],
                    help="train.conv_layout")
    args = ap.parse_args()

    import torch

    import round_speed

    tmp = Path(tempfile.mkdtemp())
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


if __name__ == "__main__":
    main()
