"""The curriculum chapter's Table 2.2 (FedAvg) and 2.3 (FedProx) in the thesis's form, on
Fashion-MNIST with LeNet-5, at a stated CPU budget (spec ``curriculum-and-pruning.md`` §1.10–1.11).

Setting (the thesis's, except where marked **budget**): 100 clients, 10 per round, Dir(β) for
β ∈ {0.05, 0.2, 0.9}, batch 10, the default curriculum (s_G, linear pacing, a = 0.8, b = 0.2),
orderings curr / anti / random / vanilla, FedAvg and FedProx (μ = 0.01, the grid's larger value),
mean ± std over ``--seeds`` trials (seeds 202207 + trial, spec §1.12). **Budget**: ``--rounds``
rounds (thesis 100) of ``--epochs`` local epochs (thesis 10); plain SGD at lr ``--lr`` (the thesis's
momentum 0.9, weight decay and decaying step size are not in flockfl's local trainer); Fashion-MNIST
instead of CIFAR-10 (CIFAR-10 cannot be read offline here; the thesis lists FMNIST but prints no
FMNIST numbers); ``lenet5`` is flockfl's LeNet-5 (padding 2 on the first conv, 400 FC inputs; the
thesis's FMNIST variant has 256).

Metric: the final global model's accuracy over every client's test data (clients' test sets follow
their label mix): the thesis's convention for this chapter, which makes no personalised claim, so no
fine-tuned convention is computed here.

  OMP_NUM_THREADS=2 python benchmarks/curriculum_table.py                       # default budget
  OMP_NUM_THREADS=2 python benchmarks/curriculum_table.py --rounds 100 --epochs 10 --seeds 3   # the thesis's
  python benchmarks/curriculum_table.py --dataset digits                          # no Fashion-MNIST: digits
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ORDERS = ("curr", "anti", "random", "vanilla")
BETAS = (0.05, 0.2, 0.9)
# thesis Tables 2.2 and 2.3: CIFAR-10, LeNet-5, 100 rounds × 10 epochs (mean, std)
THESIS = {
    "fedavg": {0.05: ((46.34, 1.55), (31.16, 3.16), (41.91, 2.23), (39.56, 4.91)),
               0.2: ((51.09, 0.39), (42.34, 1.48), (46.35, 1.44), (46.75, 0.72)),
               0.9: ((55.36, 0.69), (46.86, 0.35), (52.42, 0.90), (52.19, 0.73))},
    "fedprox": {0.05: ((47.94, 0.96), (36.08, 1.52), (42.62, 0.35), (41.48, 0.29)),
                0.2: ((50.02, 0.15), (40.92, 0.90), (46.41, 1.12), (46.18, 0.90)),
                0.9: ((56.48, 0.18), (48.37, 0.91), (51.69, 0.40), (53.07, 1.25))},
}


def config(args, alg: str, beta: float, order: str, seed: int) -> dict:
    algorithm = {"name": alg, **({"mu": 0.01} if alg == "fedprox" else {})}
    return {
        "name": f"curriculum-{alg}-{beta}-{order}", "seed": seed,
        "dataset": {"name": args.dataset}, "model": {"name": args.model},
        "partition": {"scheme": "dirichlet", "alpha": beta, "num_clients": args.clients},
        "algorithm": algorithm,
        "train": {"rounds": args.rounds, "clients_per_round": args.per_round, "local_epochs": args.epochs,
                  "batch_size": 10, "lr": args.lr, "engine": args.engine, "eval_every": args.rounds,
                  "eval_finetune": "off"},
        "curriculum": {"ordering": order},
        "tracking": {"enabled": False},
    }


def run_one(cfg_dict: dict, partitions: Path) -> dict:
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds
    from flockfl.evaluation import summarise

    prep = prepare(validate(cfg_dict), partitions)
    t0 = time.perf_counter()
    state = run_rounds(prep)
    out = summarise(state)["metrics"]
    out["wall_s"] = time.perf_counter() - t0
    return out


def ms(vals: list[float]) -> str:
    a = 100 * np.asarray(vals)
    return f"{a.mean():5.2f} ± {a.std():4.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion_mnist")
    p.add_argument("--model", default="lenet5")
    p.add_argument("--algorithms", nargs="+", default=["fedavg", "fedprox"])
    p.add_argument("--betas", nargs="+", type=float, default=list(BETAS))
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--engine", default="auto", help="auto times both trainers (on CPU the loop wins for LeNet-5)")
    p.add_argument("--json", help="write every run's metrics here")
    args = p.parse_args(argv)
    results: dict = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for alg in args.algorithms:
            for beta in args.betas:
                for order in ORDERS:
                    runs = [run_one(config(args, alg, beta, order, 202207 + s), Path(tmp)) for s in range(args.seeds)]
                    results[(alg, beta, order)] = runs
                    print(f"  {alg} Dir({beta}) {order}: " + ", ".join(f"{100 * r['accuracy']:.2f}" for r in runs)
                          + f"  ({sum(r['wall_s'] for r in runs):.0f}s)", flush=True)
    print(f"\n{args.dataset}, {args.model}, {args.clients} clients, {args.per_round}/round, {args.rounds} rounds × "
          f"{args.epochs} epochs, lr {args.lr}, {args.seeds} seeds; wall {time.perf_counter() - t_all:.0f}s")
    for alg in args.algorithms:
        for conv, key in (("global model", "accuracy"),):
            print(f"\n{alg} — ours ({conv}), mean ± std %")
            print("| Non-IIDness | Curriculum | Anti | Random | Vanilla | curr − vanilla | thesis (CIFAR-10) curr / anti / random / vanilla |")
            print("|---|---|---|---|---|---|---|")
            for beta in args.betas:
                cells = [ms([r[key] for r in results[(alg, beta, o)]]) for o in ORDERS]
                gain = 100 * (np.mean([r[key] for r in results[(alg, beta, "curr")]])
                              - np.mean([r[key] for r in results[(alg, beta, "vanilla")]]))
                th = THESIS.get(alg, {}).get(beta)
                ths = " / ".join(f"{m:.2f}" for m, _ in th) if th else "–"
                print(f"| Dir(β={beta}) | " + " | ".join(cells) + f" | {gain:+.2f} | {ths} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{a}|{b}|{o}": v for (a, b, o), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
