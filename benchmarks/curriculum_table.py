"""The curriculum chapter's Table 2.2 (FedAvg) and 2.3 (FedProx) in the thesis's form, on
Fashion-MNIST with LeNet-5, at a stated CPU budget (spec ``curriculum-and-pruning.md`` §1.10–1.11).

Setting (the thesis's, except where marked **budget**): 100 clients, 10 per round, Dir(β) for
β ∈ {0.05, 0.2, 0.9}, batch 10, the default curriculum (s_G, linear pacing, a = 0.8, b = 0.2),
orderings curr / anti / random / vanilla, FedAvg and FedProx (μ = 0.01, the grid's larger value),
mean ± std over ``--seeds`` trials (seeds 202207 + trial, spec §1.12). The local optimiser is the
thesis's (§2.8), read from ``configs/repro/curriculum.yaml``'s base so the two cannot drift: SGD,
momentum 0.9, weight decay 5e-4, η₀(1 + α·i)^−b with η₀ = 0.001, α = 0.001, b = 0.75, i the local
step reset every round (``--lr`` sets η₀; ``--plain`` runs constant-rate SGD without momentum or
weight decay, as this script did before flockfl had them). **Budget**: ``--rounds`` rounds (thesis
100) of ``--epochs`` local epochs (thesis 10); Fashion-MNIST instead of CIFAR-10 (CIFAR-10 cannot be
read offline here; the thesis lists FMNIST but prints no FMNIST numbers); ``lenet5`` is thesis
Table 3.17's LeNet-5 (256 FC inputs on 28×28).

Metric: the final global model's accuracy over every client's test data (clients' test sets follow
their label mix and together hold the test set once, so this is the whole-test-set accuracy): the
thesis's convention for this chapter, which makes no personalised claim, so no fine-tuned convention
is computed here. Under Dir(0.05) the global model swings from round to round (each client holds
1-2 labels, and the largest of a round's 10 clients typically holds ~30% of their samples, so
Algorithm 1's size-weighted mean leans on it): ``--last K`` evaluates every round and also prints
the mean of the last K, a steadier figure than the final round alone (tests/test_curriculum_setting.py
holds flockfl's FedAvg to Algorithm 1 in lockstep).

  OMP_NUM_THREADS=2 python benchmarks/curriculum_table.py                       # default budget
  OMP_NUM_THREADS=2 python benchmarks/curriculum_table.py --rounds 100 --epochs 10 --seeds 3   # the thesis's
  python benchmarks/curriculum_table.py --model mlp --lr 0.01 --epochs 2 --rounds 40 --betas 0.05 \
      --algorithms fedavg --orders vanilla --seeds 3 --seed-base 0 --last 10   # FedAvg, MLP, Dir(0.05), seeds 0-2
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


def thesis_optimiser() -> dict:
    """The local optimiser keys of ``configs/repro/curriculum.yaml``'s base (the thesis's §2.8)."""
    import yaml

    train = yaml.safe_load((ROOT / "configs/repro/curriculum.yaml").read_text())["base"]["train"]
    return {k: train[k] for k in ("lr", "momentum", "weight_decay", "lr_schedule", "lr_alpha", "lr_b")}


def config(args, alg: str, beta: float, order: str, seed: int) -> dict:
    algorithm = {"name": alg, **({"mu": 0.01} if alg == "fedprox" else {})}
    optimiser = {"lr": args.lr} if args.plain else {**thesis_optimiser(), **({"lr": args.lr} if args.lr else {})}
    every = 1 if args.last else args.rounds
    return {
        "name": f"curriculum-{alg}-{beta}-{order}", "seed": seed,
        "dataset": {"name": args.dataset}, "model": {"name": args.model},
        "partition": {"scheme": "dirichlet", "alpha": beta, "num_clients": args.clients},
        "algorithm": algorithm,
        "train": {"rounds": args.rounds, "clients_per_round": args.per_round, "local_epochs": args.epochs,
                  "batch_size": 10, **optimiser, "engine": args.engine, "eval_every": every, "eval_finetune": "off"},
        "curriculum": {"ordering": order},
        "tracking": {"enabled": False},
    }


def run_one(cfg_dict: dict, partitions: Path) -> dict:
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds
    from flockfl.eval_summary import summarise

    prep = prepare(validate(cfg_dict), partitions)
    t0 = time.perf_counter()
    state = run_rounds(prep)
    out = summarise(state)["metrics"]
    out["wall_s"] = time.perf_counter() - t0
    out["curve"] = [row["accuracy"] for row in state.history if "accuracy" in row]
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
    p.add_argument("--lr", type=float, help="η₀ (default: the thesis's 0.001; with --plain 0.05)")
    p.add_argument("--plain", action="store_true", help="constant-rate SGD, no momentum or weight decay")
    p.add_argument("--last", type=int, default=0, help="evaluate every round and print the mean of the last K too")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--seed-base", type=int, default=202207, help="trial t runs seed SEED_BASE + t (the thesis's 202207)")
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    p.add_argument("--engine", default="auto", help="auto times both trainers (on CPU the loop wins for LeNet-5)")
    p.add_argument("--json", help="write every run's metrics here")
    args = p.parse_args(argv)
    if args.plain and args.lr is None:
        args.lr = 0.05
    results: dict = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for alg in args.algorithms:
            for beta in args.betas:
                for order in args.orders:
                    runs = [run_one(config(args, alg, beta, order, args.seed_base + s), Path(tmp)) for s in range(args.seeds)]
                    results[(alg, beta, order)] = runs
                    if args.last:
                        for r in runs:
                            r["last_mean"] = float(np.mean(r["curve"][-args.last:]))
                    last = (f"; mean of the last {args.last}: " + ", ".join(f"{100 * r['last_mean']:.2f}" for r in runs)
                            if args.last else "")
                    print(f"  {alg} Dir({beta}) {order}: " + ", ".join(f"{100 * r['accuracy']:.2f}" for r in runs) + last
                          + f"  ({sum(r['wall_s'] for r in runs):.0f}s)", flush=True)
    opt = (f"plain SGD lr {args.lr}" if args.plain else
           "SGD momentum {momentum}, weight decay {weight_decay}, lr {lr}·(1 + {lr_alpha}·i)^-{lr_b}".format(
               **{**thesis_optimiser(), **({"lr": args.lr} if args.lr else {})}))
    print(f"\n{args.dataset}, {args.model}, {args.clients} clients, {args.per_round}/round, {args.rounds} rounds × "
          f"{args.epochs} epochs, {opt}, {args.seeds} seeds; wall {time.perf_counter() - t_all:.0f}s")
    conventions = (("global model, final round", "accuracy"),) + (
        ((f"global model, mean of the last {args.last} rounds", "last_mean"),) if args.last else ())
    for alg in args.algorithms:
        for conv, key in conventions:
            print(f"\n{alg} — ours ({conv}), mean ± std %")
            print("| Non-IIDness | Curriculum | Anti | Random | Vanilla | curr − vanilla | thesis (CIFAR-10) curr / anti / random / vanilla |")
            print("|---|---|---|---|---|---|---|")
            for beta in args.betas:
                cells = [ms([r[key] for r in results[(alg, beta, o)]]) if (alg, beta, o) in results else "–" for o in ORDERS]
                both = all((alg, beta, o) in results for o in ("curr", "vanilla"))
                gain = 100 * (np.mean([r[key] for r in results[(alg, beta, "curr")]])
                              - np.mean([r[key] for r in results[(alg, beta, "vanilla")]])) if both else float("nan")
                th = THESIS.get(alg, {}).get(beta)
                ths = " / ".join(f"{m:.2f}" for m, _ in th) if th else "–"
                print(f"| Dir(β={beta}) | " + " | ".join(cells) + f" | {gain:+.2f} | {ths} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{a}|{b}|{o}": v for (a, b, o), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
