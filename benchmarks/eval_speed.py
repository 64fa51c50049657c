"""Seconds of one full evaluation: flockfl against the plain per-client loop a researcher writes.

A full evaluation measures every client on both test sets: its proportional split and its label
union (every test sample of every label it holds, the PACFL/FLIS/Sub-FedAvg protocol). Workloads
(100 clients unless said otherwise):

- ``mlp/digits``: MLP 64-200-10 on scikit-learn's digits, 100 clients × 2 shards;
- ``cnn_bn/fmnist``: the thesis's CNN with BatchNorm on Fashion-MNIST, 100 clients × 2 shards of 250;
- ``lenet5/fmnist``: LeNet-5 on the same partition.

Two regimes per workload: ``shared`` (every client under one model: FedAvg, a cluster) and
``own`` (a model per client: personalised, pruned or fine-tuned; here 100 seeded perturbations
of one model). The loop, for every client: pick its label-union samples out of the test set
(``x_test[np.isin(y_test, held)]``), run its model in eval mode, cross-entropy and accuracy; then
the same on its proportional split. flockfl: ``measure_shared`` / ``measure_own``.

The FLOP floor is rows × model FLOPs ÷ the measured peak of a 1024³ float32 matmul on the same
threads: ``rows`` are what flockfl must evaluate (shared: the pool's rows of the held classes,
once; own: each client's label-union rows; the proportional rows ride along in the same pass),
``loop rows`` what the loop evaluates. Both paths are checked to agree before they are timed.

``--subfedavg ROUNDS`` instead times a whole run: Sub-FedAvg (unstructured pruning on FedAvg),
``cnn_bn`` on the Fashion-MNIST shards above (10 clients per round, 2 local epochs, batch 10,
``train.eval_every=10``, the default fine-tuned convention at the last round), without Prefect:
the wall time, and per round the time of training-only rounds and of evaluated ones. It uses
only APIs older than the protocols, so the same file run from an older checkout times that
code (``PYTHONPATH=<checkout> python <checkout>/benchmarks/eval_speed.py --subfedavg 30``).

Usage: python benchmarks/eval_speed.py [--threads 1] [--repeat 3] [--workloads mlp/digits,cnn_bn/fmnist,lenet5/fmnist]
       python benchmarks/eval_speed.py --subfedavg 90
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FMNIST = "/usr/share/datasets/fashion-mnist"
# the partitions the workloads write, removed when the script ends
_TMP = tempfile.TemporaryDirectory(prefix="flockfl-eval-speed-")


def scratch() -> Path:
    return Path(tempfile.mkdtemp(dir=_TMP.name))
WORKLOADS = {
    "mlp/digits": ({"name": "digits"}, {"name": "mlp", "hidden": 200}, {"shard_size": None}),
    "cnn_bn/fmnist": ({"name": "fashion_mnist", "path": FMNIST}, {"name": "cnn_bn"}, {"shard_size": 250}),
    "lenet5/fmnist": ({"name": "fashion_mnist", "path": FMNIST}, {"name": "lenet5"}, {"shard_size": 250}),
}


def config(dataset: dict, model: dict, part: dict, clients: int, threads: int = 1) -> dict:
    # train.threads: prepare() sets torch's threads from it (its default, the cores, would
    # silently override --threads for both paths)
    return {"name": "eval-speed", "seed": 0, "dataset": dataset, "model": model, "algorithm": {"name": "fedavg"},
            "partition": {"scheme": "shards", "num_clients": clients, "classes_per_client": 2, **part},
            "train": {"rounds": 1, "clients_per_round": 10, "engine": "vectorized", "threads": threads},
            # both test sets for every model: the full evaluation this script times (the default,
            # conventions=cheap, measures the label union only where it costs no extra pass)
            "eval": {"conventions": "all"}, "tracking": {"enabled": False}}


def model_flops(model, input_shape) -> float:
    """2 × multiply-adds of every convolution and linear layer for one sample."""
    import torch
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional

    class Count(TorchFunctionMode):
        macs = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is F.conv2d:
                w = args[1]
                Count.macs += out.numel() * w[0].numel()
            elif func is F.linear:
                Count.macs += out.numel() * args[1].shape[1]
            return out

    with torch.no_grad(), Count():
        model.eval()(torch.zeros(1, *input_shape))
    return 2.0 * Count.macs


def peak_flops(repeat: int = 10) -> float:
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 1024 ** 3 / best


def plain_loop(model, params_of, data, clients, ds_test) -> tuple[np.ndarray, np.ndarray]:
    """The researcher's loop: per client, its label-union set out of the test set, then its own split."""
    import torch
    from torch.func import functional_call

    x_all, y_all = ds_test
    model.eval()
    acc_lu, acc_prop = [], []
    with torch.no_grad():
        for i, c in enumerate(clients):
            p = params_of(i)
            held = torch.unique(data.train.client(int(c))[1])
            mask = torch.isin(y_all, held)
            out = functional_call(model, p, (x_all[mask],))
            torch.nn.functional.cross_entropy(out, y_all[mask])
            acc_lu.append(float((out.argmax(-1) == y_all[mask]).float().mean()))
            x, y = data.test.client(int(c))
            out = functional_call(model, p, (x,))
            torch.nn.functional.cross_entropy(out, y)
            acc_prop.append(float((out.argmax(-1) == y).float().mean()))
    return np.array(acc_lu), np.array(acc_prop)


def timed(fn, repeat: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result to check)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def run(name: str, clients: int, repeat: int, peak: float, threads: int = 1) -> list[dict]:
    import torch

    from flockfl.engine.functional import stack
    from flockfl.evaluation import _Measure, measure_own, measure_shared
    from flockfl.experiments import validate
    from flockfl.rounds import prepare
    from models import init_params

    ds_cfg, model_cfg, part = WORKLOADS[name]
    prep = prepare(validate(config(ds_cfg, model_cfg, part, clients, threads)), scratch())
    assert torch.get_num_threads() == max(threads, 1) or threads == 0, 'threads not as asked'
    ctx, data = prep.ctx, prep.ctx.data
    pool = ctx.base_data.pool
    ids = np.arange(ctx.num_clients)
    base = init_params(ctx.model, torch.Generator().manual_seed(0))
    own = stack([{k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(int(i))) for k, v in base.items()}
                 for i in ids])
    shared = {k: v.unsqueeze(0) for k, v in base.items()}
    ds_test = (pool.x[0], pool.labels())  # the whole test set (sorted by class; no transform in these partitions)
    flops = model_flops(ctx.model, data.input_shape)
    m = _Measure(ctx, ids)
    shared_rows = int(sum(b - a for a, b in pool.runs(np.flatnonzero(m.mask.any(0)))))
    own_rows = int(m.count["label_union"].sum())
    loop_rows = int(m.count["label_union"].sum() + m.count["proportional"].sum())
    out = []
    for regime, params_of, fl in (
            ("shared", lambda i: base, lambda: measure_shared(ctx, shared, np.zeros(len(ids), np.int64), ids)),
            ("own", lambda i: {k: v[i] for k, v in own.items()}, lambda: measure_own(ctx, own, ids))):
        t_loop, (lu, prop) = timed(lambda: plain_loop(ctx.model, params_of, data, ids, ds_test), repeat)
        t_fl, cm = timed(fl, repeat)
        for ts, want in (("label_union", lu), ("proportional", prop)):  # the same, up to a near-tie's argmax
            _, acc, n = cm[ts]
            assert (np.abs(acc - want) <= 1.0 / np.maximum(n, 1) + 1e-9).all(), f"{name}/{regime}/{ts}: flockfl ≠ loop"
        rows = shared_rows if regime == "shared" else own_rows
        floor = rows * flops / peak
        out.append({"workload": name, "regime": regime, "loop_s": t_loop, "flockfl_s": t_fl, "speedup": t_loop / t_fl,
                    "rows": rows, "loop_rows": loop_rows, "mflop_per_row": flops / 1e6, "floor_s": floor,
                    "over_floor": t_fl / floor})
    return out


def subfedavg(rounds: int, threads: int) -> None:
    """Time the Sub-FedAvg run (see the module docstring)."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    raw = config({"name": "fashion_mnist", "path": FMNIST}, {"name": "cnn_bn"}, {}, 100)
    raw["pruning"] = {"method": "unstructured"}
    del raw["eval"]  # the run as a user runs it: flockfl's default conventions
    raw["train"] = {"rounds": rounds, "clients_per_round": 10, "local_epochs": 2, "batch_size": 10, "eval_every": 10,
                    "threads": threads, "engine": "vectorized"}
    t0 = time.perf_counter()
    prep = prepare(validate(raw), scratch())
    t1 = time.perf_counter()
    state = run_rounds(prep)
    t2 = time.perf_counter()
    evals = [h for h in state.history if "accuracy" in h]
    train = [h["round_time_s"] for h in state.history if "accuracy" not in h]
    mean_train = float(np.mean(train)) if train else float("nan")
    per_eval = [h["round_time_s"] - mean_train for h in evals]
    print(f"sub-fedavg unstructured, cnn_bn FMNIST shards, 100 clients, {rounds} rounds, eval_every=10, threads={threads}")
    print(f"prepare {t1 - t0:.1f} s; rounds {t2 - t1:.1f} s; training-only round {mean_train:.2f} s (median "
          f"{np.median(train):.2f}); evaluated rounds {len(evals)}: " + ", ".join(f"{h['round_time_s']:.1f}" for h in evals)
          + " s")
    print("evaluation cost per evaluated round (its time − a training round): " + ", ".join(f"{v:.1f}" for v in per_eval)
          + " s; the last adds the fine-tuned convention")
    print(f"accuracy {evals[-1]['accuracy']:.4f}, accuracy_pruned {evals[-1].get('accuracy_pruned', float('nan')):.4f}"
          + "".join(f", {k} {evals[-1][k]:.4f}" for k in ("accuracy_pruned__label_union__samples",) if k in evals[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--subfedavg", type=int, metavar="ROUNDS", help="time the Sub-FedAvg run instead")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.subfedavg:
        return subfedavg(args.subfedavg, args.threads)
    peak = peak_flops()
    print(f"threads={args.threads}  peak matmul {peak / 1e9:.1f} GFLOP/s (1024³ float32)  torch {torch.__version__}")
    rows = [r for w in args.workloads.split(",") for r in run(w, args.clients, args.repeat, peak, args.threads)]
    head = f"{'workload':<15}{'regime':<8}{'loop s':>9}{'flockfl s':>11}{'ratio':>8}{'rows':>10}{'loop rows':>11}" \
           f"{'MFLOP/row':>11}{'floor s':>10}{'÷ floor':>9}"
    print(head)
    for r in rows:
        print(f"{r['workload']:<15}{r['regime']:<8}{r['loop_s']:>9.3f}{r['flockfl_s']:>11.3f}{r['speedup']:>8.1f}"
              f"{r['rows']:>10}{r['loop_rows']:>11}{r['mflop_per_row']:>11.3f}{r['floor_s']:>10.3f}{r['over_floor']:>9.2f}")


if __name__ == "__main__":
    main()
