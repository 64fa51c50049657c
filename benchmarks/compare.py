"""Run several algorithms on one partition and print a markdown table.

Every algorithm runs through the real experiment flow (Prefect, checkpoints, MLflow), as a
nested MLflow run under one parent run, all in this one process: this is ``flockfl sweep``'s
machinery (flows/sweep_plan.py, flows/sweep_run.py) with one named variant per algorithm.
Running the same command again continues an interrupted comparison. Columns: final and best
mean client accuracy, final 10th-percentile client accuracy, rounds and simulated time to the
target accuracy, wall seconds.

Examples:
  python benchmarks/compare.py --base digits_dirichlet            # offline, bundled digits
  python benchmarks/compare.py --base configs/compare_fmnist.yaml  # Fashion-MNIST Dirichlet(0.1)
  python benchmarks/compare.py --base digits_dirichlet --algorithms fedavg scaffold --set train.rounds=10
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.env import configure_environment  # noqa: E402

ALL = ["fedavg", "fedsgd", "fedprox", "fednova", "scaffold", "fedadam", "fedadagrad", "fedyogi", "fedavgm",
       "fedsplit", "ccfl", "fedeff"]


def algorithm_overrides(name: str, cfg) -> list[str]:
    """Settings an algorithm needs to be comparable with the others on the same budget."""
    t, p = cfg.train, cfg.partition
    if name == "ccfl":
        # K_{t,i} ~ U{1..K} (K = train.local_steps, else 10 per local epoch); CC-FedAvg's η ≈ mean K
        # (spec §3.4); availability chosen so that the expected cohort matches clients_per_round
        steps = t.local_steps or 10 * t.local_epochs
        return [f"train.local_steps={steps}", f"algorithm.availability={t.clients_per_round / p.num_clients}",
                f"algorithm.server_lr={(steps + 1) / 2}"]
    return []


def run_variants(base_ref: str, variants: list[tuple[str, list[str]]], overrides: list[str], params: str,
                 tracking_uri=None, parent_name: str | None = None, parallel: int = 1):
    """Every (label, overrides) variant of one base config in this process (``flockfl sweep``'s
    machinery), each a nested MLflow run under one parent; returns (base config, MLflow parent
    run id, [(label, summary, best accuracy)]). A bad config or an impossible partition raises
    ConfigError before anything runs; the same call again continues an interrupted comparison."""
    from mlflow.tracking import MlflowClient

    from flows.sweep_plan import plan_sweep

    plan = plan_sweep(base_ref, [], None, overrides, params, variants=variants)
    from flows.sweep_run import run_sweep

    base = plan.base
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = run_sweep(plan, Path("runs") / f"compare-{base.name}-{plan.digest[:10]}", tracking_uri, "data/partitions",
                       parallel, parent_name or f"compare-{stamp}", experiment=f"compare-{base.name}")
    client = MlflowClient(result.tracking_uri)
    rows = []
    for child in plan.children:
        if child.status != "finished":
            print(f"compare: {child.label} failed: {child.error}", file=sys.stderr)
            continue
        hist = client.get_metric_history(child.summary["run_id"], "accuracy") if child.summary.get("run_id") else []
        rows.append((child.label, child.summary, max((m.value for m in hist), default=float("nan"))))
    return base, result.parent_run_id, rows


COLUMNS = [  # (header, summary key or metric, format)
    ("acc (cluster/global model)", "accuracy", ".3f"), ("p10", "accuracy_p10", ".3f"),
    ("acc after local training", "accuracy_finetuned", ".3f"), ("p10 ", "accuracy_finetuned_p10", ".3f"),
    ("ARI", "ari", ".3f"), ("clusters", "num_clusters", "d"), ("unseen acc", "unseen_accuracy", ".3f"),
    ("rounds to target", "rounds_to_target", "d"), ("sim_time to target (s)", "sim_time_to_target", ".1f"),
    ("MB sent", "mb_total", ".1f"), ("wall s", "wall_s", ".1f"),
]


def table(rows, columns=COLUMNS, extra: dict | None = None) -> str:
    """A markdown table of the rows; ``extra`` adds columns {header: {label: text}} (e.g. a paper's numbers)."""
    fmt = lambda v, f: "–" if v is None or v != v else format(v, f)  # noqa: E731
    heads = ["algorithm"] + list(extra or {}) + [c[0] for c in columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for name, s, best in rows:
        m = {**s["metrics"], **{k: s.get(k) for k in ("rounds_to_target", "sim_time_to_target", "wall_s")}}
        m["mb_total"] = s.get("bytes_total", 0) / 1e6
        m["best"] = best
        cells = [name] + [(extra[h].get(name, "–")) for h in (extra or {})] + [fmt(m.get(key), f) for _, key, f in columns]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="digits_dirichlet", help="an experiment in params.yaml or a YAML config")
    ap.add_argument("--algorithms", nargs="+", default=ALL)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--target", type=float, default=None, help="target mean client accuracy (default: train.target_accuracy)")
    ap.add_argument("--tracking-uri")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (threads sharing the cores)")
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    args = ap.parse_args()
    configure_environment()
    from flows import apiserver

    apiserver.start()  # Prefect's API starts on the other core while torch, MLflow and the data load
    from flockfl.errors import ConfigError
    from flockfl.experiments import load_experiment

    try:
        base = load_experiment(args.base, args.overrides, args.params)
        target = args.target if args.target is not None else base.train.target_accuracy
        extra = [f"train.target_accuracy={target}"] if target is not None else []
        variants = [(a, extra + [f"algorithm.name={a}"] + algorithm_overrides(a, base)) for a in args.algorithms]
        base, parent, rows = run_variants(args.base, variants, args.overrides, args.params, args.tracking_uri,
                                          parallel=args.parallel)
    except ConfigError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2
    print(f"\n{base.dataset.name} / {base.partition.scheme}"
          f"{f'(α={base.partition.alpha})' if base.partition.scheme == 'dirichlet' else ''}, "
          f"{base.partition.num_clients} clients, {base.train.clients_per_round} per round, {base.model.name}, "
          f"{base.train.rounds} rounds; target accuracy {target}; MLflow parent run {parent}\n")
    print(table(rows, [("final acc", "accuracy", ".3f"), ("best acc", "best", ".3f"), ("p10 acc", "accuracy_p10", ".3f"),
                       ("rounds to target", "rounds_to_target", "d"), ("sim_time to target (s)", "sim_time_to_target", ".1f"),
                       ("acc after local training", "accuracy_finetuned", ".3f"), ("ARI", "ari", ".3f"),
                       ("clusters", "num_clusters", "d"), ("MB sent", "mb_total", ".1f"), ("wall s", "wall_s", ".1f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
