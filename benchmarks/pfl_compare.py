"""flockfl against pfl-research (``pip install pfl``) on pfl-research's CIFAR-10 benchmark setup,
on the same device in one process: client updates per second.

The setup (pfl-research benchmarks/image_classification/configs/baseline.yaml): 1,000 users ×
50 images of 32×32×3, 50 users per central iteration, FedAvg, 1 local epoch, local batch 10,
local SGD lr 0.1, central SGD lr 1.0, every user weighted alike; the model is its ``simple_cnn``
(conv 32 → conv 64 → max-pool → FC 128 → out). The data are synthetic (inputs ~ N(0, 1),
labels from a random linear teacher): nothing is downloaded, and speed does not depend on them.

- pfl: ``SimulatedBackend`` + ``FederatedAveraging`` + ``PyTorchModel``, one process (its
  default simulation: users trained one after another on the device), users sampled by its
  ``minimize_reuse`` sampler, user data held as tensors on the device (as its benchmarks'
  ``numpy_to_tensor``), no evaluation. Its model is pfl-research's ``simple_cnn`` with its two
  dropout layers and Glorot-uniform weights. A central iteration is timed from one
  ``after_central_iteration`` callback to the next (CUDA synchronised).
- flockfl: the same population, cohort and hyper-parameters; ``pfl_cnn`` (that CNN without
  dropout: flockfl's trainers draw no dropout masks; the two dropouts cost a few element-wise
  ops). A round (select → train → aggregate, no evaluation) is timed with
  ``flockfl.rounds.drive_round``, once per trainer (``vectorized``, ``reference``).

Each row: the median over ``--rounds`` timed rounds after ``--warmup`` rounds.

Usage: python benchmarks/pfl_compare.py [--device cuda|cpu] [--rounds 10] [--warmup 2] [--quick]
       (needs ``pip install pfl``; without it the pfl row says so and flockfl's rows still run)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpu_speed import sync  # a CUDA synchronise around each timing (benchmarks/ is this script's path)

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (32, 32, 3)  # pfl's NHWC image shape
CLASSES, BATCH, LOCAL_LR, CENTRAL_LR = 10, 10, 0.1, 1.0


def make_data(users: int, per_user: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """NHWC images ~ N(0, 1) and labels of a random linear teacher, ``per_user`` per user in order."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((users * per_user, *SHAPE)).astype(np.float32)
    teacher = rng.standard_normal((int(np.prod(SHAPE)), CLASSES)).astype(np.float32)
    y = (x.reshape(len(x), -1) @ teacher).argmax(1)
    return x, y


# ---------------------------------------------------------------------- pfl


def pfl_model():
    """pfl-research's simple_cnn for 32×32×3 (NHWC in, transposed to NCHW), with the ``loss`` and
    ``metrics`` methods pfl's PyTorchModel calls."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class NHWCtoNCHW(nn.Module):
        def forward(self, x):
            return x.permute(0, 3, 1, 2)

    class SimpleCNN(nn.Sequential):
        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):
            from pfl.metrics import Weighted

            self.eval() if eval else self.train()
            logits = self(x)
            n = len(y)
            return {"loss": Weighted(F.cross_entropy(logits, y, reduction="sum").item(), n),
                    "accuracy": Weighted((logits.argmax(1) == y).sum().item(), n)}

    flat = ((SHAPE[0] - 4) // 2) ** 2 * 64
    model = SimpleCNN(NHWCtoNCHW(), nn.Conv2d(SHAPE[2], 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                      nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(), nn.Linear(flat, 128), nn.ReLU(),
                      nn.Dropout(0.5), nn.Linear(128, CLASSES))
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
    return model


def time_pfl(x: np.ndarray, y: np.ndarray, args) -> dict:
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.pytorch_ops import get_default_device
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    device = get_default_device()
    torch.manual_seed(0)
    xs, ys = torch.as_tensor(x).to(device), torch.as_tensor(y).to(device)
    data = {u: [xs[u * args.per_user:(u + 1) * args.per_user], ys[u * args.per_user:(u + 1) * args.per_user]]
            for u in range(args.users)}
    train = FederatedDataset.from_slices(data, get_user_sampler("minimize_reuse", list(range(args.users))))
    net = pfl_model().to(device)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), CENTRAL_LR))
    backend = SimulatedBackend(training_data=train, val_data=None, postprocessors=[WeightByUser()])
    stamps: list[float] = []

    class Stamp(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            sync(device)
            stamps.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            sync(device)
            stamps.append(time.perf_counter())
            return False, Metrics()

    iterations = args.warmup + args.rounds
    with contextlib.redirect_stdout(sys.stderr):  # its per-iteration metrics printout (kept: part of its cost)
        FederatedAveraging().run(
            algorithm_params=NNAlgorithmParams(central_num_iterations=iterations, evaluation_frequency=iterations + 1,
                                               train_cohort_size=args.cohort, val_cohort_size=0),
            backend=backend, model=model,
            model_train_params=NNTrainHyperParams(local_learning_rate=LOCAL_LR, local_num_epochs=1,
                                                  local_batch_size=BATCH),
            model_eval_params=NNEvalHyperParams(local_batch_size=10000), callbacks=[Stamp()])
    s = float(np.median(np.diff(stamps)[args.warmup:]))
    return {"round_s": s, "device": str(device)}


# ---------------------------------------------------------------------- flockfl


def time_flockfl(x: np.ndarray, y: np.ndarray, engine: str, args, work: Path) -> dict:
    from flockfl.experiments import validate
    from flockfl.rounds import PLAIN, drive_round, prepare

    npz = work / "pfl-cifar.npz"
    if not npz.exists():
        n = args.users * args.per_user
        client = np.repeat(np.arange(args.users), args.per_user)
        np.savez(npz, x_train=x.transpose(0, 3, 1, 2), y_train=y, x_test=x[:args.users].transpose(0, 3, 1, 2),
                 y_test=y[:args.users], client_train=client, client_test=np.arange(args.users))
        assert len(client) == n
    raw = {
        "name": "pfl-cifar10", "seed": 0,
        "dataset": {"name": "npz", "path": str(npz)},
        "partition": {"scheme": "natural", "num_clients": args.users},
        "model": {"name": "pfl_cnn"},
        "algorithm": {"name": "fedavg"},  # weights by samples: every user holds 50, so alike (pfl's WeightByUser)
        "train": {"rounds": 10_000, "eval_every": 10_000, "clients_per_round": args.cohort, "local_epochs": 1,
                  "batch_size": BATCH, "lr": LOCAL_LR, "engine": engine, "device": args.device,
                  "eval_finetune": "off", "threads": args.threads},
        "tracking": {"enabled": False},
    }
    prep = prepare(validate(raw), work / "parts")
    state = prep.algorithm.init_state(prep.ctx)
    device = prep.ctx.data.train.x.device
    times = []
    for r in range(args.warmup + args.rounds):
        sync(device)
        t0 = time.perf_counter()
        state, row = drive_round(prep, state, r, PLAIN)
        sync(device)
        times.append(time.perf_counter() - t0)
        if row["clients_dropped"]:
            raise SystemExit(f"flockfl {engine}: {row['clients_dropped']} clients failed to train")
    return {"round_s": float(np.median(times[args.warmup:])), "device": str(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--per-user", type=int, default=50)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads for both (0: the cores, at most 4)")
    ap.add_argument("--quick", action="store_true", help="100 users, 10 per round, 3 timed rounds (a smoke run)")
    ap.add_argument("--skip", nargs="*", default=[], choices=("pfl", "vectorized", "reference"))
    args = ap.parse_args()
    if args.quick:
        args.users, args.cohort, args.rounds, args.warmup = 100, 10, 3, 1
    sys.path.insert(0, str(ROOT))
    import torch

    from flockfl.engine import configure_threads

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pfl_compare: no CUDA device here; use --device cpu")
    args.threads = configure_threads(args.threads)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    x, y = make_data(args.users, args.per_user)
    print(f"device: {where} ({args.threads} CPU threads); torch {torch.__version__}; {args.users} users × "
          f"{args.per_user} images 32×32×3, {args.cohort} per round, FedAvg, 1 epoch, batch {BATCH}; "
          f"median of {args.rounds} rounds after {args.warmup} warm-up")
    rows = []
    if "pfl" not in args.skip:
        try:
            import pfl
        except ModuleNotFoundError:
            print("pfl: not installed; `pip install pfl` to add its row", file=sys.stderr)
        else:
            rows.append((f"pfl {pfl.__version__} (SimulatedBackend, simple_cnn + dropout)", time_pfl(x, y, args)))
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("vectorized", "reference"):
            if engine not in args.skip:
                rows.append((f"flockfl {engine} (pfl_cnn)", time_flockfl(x, y, engine, args, Path(tmp))))
    base = next((r["round_s"] for name, r in rows if name.startswith("pfl")), None)
    print()
    print("| framework | s/round | client updates/s | vs pfl |")
    print("|---|---|---|---|")
    for name, r in rows:
        ratio = f"{base / r['round_s']:.2f}x" if base else "-"
        print(f"| {name} | {r['round_s']:.4f} | {args.cohort / r['round_s']:,.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
