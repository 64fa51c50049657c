"""What a W1 round pays after local training, with the low-rank layer's weights written out (as
before stop 47) and on its factors (now): FedAvg's finite check and weighted mean, SCAFFOLD's
finite check, mean and option II control variates c_i⁺.

W1: MLP 784-200-10, 120 clients of 50 samples, batch 10, one local epoch (5 steps, rank 50),
from one shared start; SCAFFOLD with random c − c_i. Both ways on the same trained result, the
medians of ``--repeats`` cohorts, at ``--threads``. Prints a table (ms).

Usage: python benchmarks/lowrank_mean.py [--threads 1] [--repeats 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import numpy as np
    import torch

    from flockfl.aggregation import mean_weights, weighted_mean
    from flockfl.engine import LocalSpec, fused, train_cohort
    from flockfl.engine.data import Split
    from models import build_model, init_params
    from flockfl.rng import torch_generator

    torch.set_num_threads(args.threads)
    clients, per = 120, 50
    g = torch.Generator().manual_seed(0)
    data = Split(torch.rand(clients * per, 1, 28, 28, generator=g), torch.randint(0, 10, (clients * per,), generator=g),
                 np.arange(0, clients * per + 1, per, dtype=np.int64))
    model = build_model("mlp", (1, 28, 28), 10, 200)
    base = init_params(model, torch_generator(0, purpose="init"))
    init = {k: v.unsqueeze(0).expand(clients, *v.shape) for k, v in base.items()}
    corr = {k: 0.01 * torch.randn(clients, *v.shape, generator=g) for k, v in base.items()}
    rows = {}

    def clock(name: str, fn):
        t = time.perf_counter()
        out = fn()
        rows.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
        return out

    for rep in range(args.repeats + 1):
        for algo in ("fedavg", "scaffold"):
            spec = LocalSpec(np.arange(clients), init, 0.05, epochs=1, batch_size=10,
                             correction=corr if algo == "scaffold" else None)
            res = clock(f"{algo}: local training (5 steps)", lambda: train_cohort(model, spec, data, "classification", 0, rep))
            w = mean_weights(res.num_samples, "samples")
            clock(f"{algo}: finite check, on the factors", res.finite)
            clock(f"{algo}: mean, on the factors", lambda: weighted_mean(res.raw_params, w))
            if algo == "scaffold":  # with c = 0: c − c_i = −c_i; c_i⁺ and c_i⁺ − c_i, as Scaffold.aggregate
                steps = torch.from_numpy(res.num_steps.astype(np.float32)).reshape(-1, 1, 1)
                old_ci = -corr["1.weight"]

                def on_factors():
                    ci = res.raw_params["1.weight"].gradient_sum(1.0 / steps.reshape(-1))
                    return ci, torch.sub(ci, old_ci)

                clock(f"{algo}: c_i⁺ and c_i⁺ − c_i, on the factors", on_factors)
            dense = clock(f"{algo}: write the weights out", lambda: res.params)
            clock(f"{algo}: finite check, written out", lambda: torch.stack(
                [torch.isfinite(v.reshape(clients, -1).sum(1)) for v in dense.values()]).all(0))
            clock(f"{algo}: mean, written out", lambda: weighted_mean(dense, w))
            if algo == "scaffold":  # the one-pass kernel Scaffold.aggregate used on written-out weights
                x, zero = base["1.weight"], torch.zeros_like(base["1.weight"])
                scale = 1.0 / (steps.reshape(-1) * 0.05)
                clock(f"{algo}: c_i⁺ and c_i⁺ − c_i, written out (fused)",
                      lambda: fused.scaffold_control(x, dense["1.weight"], old_ci, zero, scale))
    print(f"threads={torch.get_num_threads()}; median of {args.repeats} cohorts (the first left out), ms\n")
    print("| step | ms |")
    print("|---|---:|")
    for name, ts in rows.items():
        print(f"| {name} | {np.median(ts[1:]):.1f} |")


if __name__ == "__main__":
    main()
