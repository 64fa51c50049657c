"""Run several algorithms on one partition and print a markdown table.

Every algorithm runs through the real experiment flow (Prefect, checkpoints, MLflow), as a
nested MLflow run under one parent run. Columns: final and best mean client accuracy, final
10th-percentile client accuracy, rounds and simulated time to the target accuracy, wall
seconds.

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


def run_one(name: str, cfg, base, stamp: str, uri: str, parent_run_id: str):
    """One algorithm through the experiment flow, as a nested MLflow run; returns a table row."""
    from mlflow.tracking import MlflowClient

    from flows.experiment import run_experiment

    cfg = cfg.model_copy(update={"name": f"{base.name}-{name}",
                                 "tracking": cfg.tracking.model_copy(update={"experiment": f"compare-{base.name}",
                                                                             "register_model": False})})
    print(f"running {name} ...", file=sys.stderr, flush=True)
    s = run_experiment(cfg, Path(f"runs/compare-{stamp}/{name}"), "data/partitions", uri, progress=False,
                       parent_run_id=parent_run_id)
    best = max((m.value for m in MlflowClient(uri).get_metric_history(s["run_id"], "accuracy")), default=float("nan"))
    return name, s, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="digits_dirichlet", help="an experiment in params.yaml or a YAML config")
    ap.add_argument("--algorithms", nargs="+", default=ALL)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--target", type=float, default=None, help="target mean client accuracy (default: train.target_accuracy)")
    ap.add_argument("--tracking-uri")
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    args = ap.parse_args()
    configure_environment()
    from flockfl.config import ConfigError, load_experiment
    from tasks.tracking import Tracker, resolve_tracking_uri

    try:
        base = load_experiment(args.base, args.overrides, args.params)
        target = args.target if args.target is not None else base.train.target_accuracy
        extra = [f"train.target_accuracy={target}"] if target is not None else []
        cfgs = {a: load_experiment(args.base, args.overrides + extra + [f"algorithm.name={a}"]
                                   + algorithm_overrides(a, base), args.params) for a in args.algorithms}
    except ConfigError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2
    uri = resolve_tracking_uri(args.tracking_uri, base.tracking.uri)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    parent = Tracker(uri, f"compare-{base.name}", f"compare-{stamp}",
                     params={"algorithms": ",".join(args.algorithms), "base": args.base, **base.to_flat()})
    rows = []
    try:
        for name, cfg in cfgs.items():
            rows.append(run_one(name, cfg, base, stamp, uri, parent.run_id))
    except ConfigError as err:  # e.g. an impossible partition, found when the data is loaded
        parent.finish("FAILED")
        print(f"compare: error: {err}", file=sys.stderr)
        return 2
    parent.finish()
    print(f"\n{base.dataset.name} / {base.partition.scheme}"
          f"{f'(α={base.partition.alpha})' if base.partition.scheme == 'dirichlet' else ''}, "
          f"{base.partition.num_clients} clients, {base.train.clients_per_round} per round, {base.model.name}, "
          f"{base.train.rounds} rounds; target accuracy {target}; MLflow parent run {parent.run_id}\n")
    print("| algorithm | final acc | best acc | p10 acc | rounds to target | sim_time to target (s) | wall s |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for name, s, best in rows:
        m = s["metrics"]
        print(f"| {name} | {m.get('accuracy', float('nan')):.3f} | {best:.3f} | {m.get('accuracy_p10', float('nan')):.3f} | "
              f"{fmt(s.get('rounds_to_target'), 'd')} | {fmt(s.get('sim_time_to_target'), '.1f')} | {s['wall_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
