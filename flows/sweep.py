"""``flockfl sweep``: every grid combination × seed of one experiment, in one process.

One Prefect API and one MLflow store serve every run; each run is a child MLflow run
(``mlflow.parentRunId``) of one parent run, tagged ``flockfl.sweep.combo`` (the grid
combination, e.g. ``train.lr=0.05``) and ``flockfl.seed``. The sweep lives in a directory
(``runs/sweep-<experiment>-<digest>``) whose ``sweep.json`` lists its runs; each run has its
own run directory inside it. Running the same command again continues the sweep: finished
runs are kept, interrupted ones resume from their checkpoints (bit-identical to an
uninterrupted run), the rest start.

Here: the command (:func:`add_parser`, :func:`cmd_sweep`). Its plan: flows/sweep_plan.py; its
runs: flows/sweep_run.py; its table: flows/sweep_table.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from flows.sweep_plan import add_run_options

    p = sub.add_parser("sweep", help="run an experiment over a grid and seeds in one process, as nested MLflow runs",
                       description="Every combination of the --grid values × every --seeds value, as child MLflow runs "
                                   "of one parent run; prints mean ± std per combination. Running the same command "
                                   "again continues an interrupted sweep.")
    p.add_argument("config", metavar="CONFIG_OR_NAME")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,…",
                   help="a config key and its values (repeat for a grid)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="seeds (default: the config's seed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="applied to every run")
    add_run_options(p)
    p.add_argument("--sweep-dir", help="the sweep's directory (default runs/sweep-<experiment>-<digest>)")
    p.add_argument("--name", help="the MLflow parent run's name (default sweep-<experiment>-<digest>)")
    p.add_argument("--register-models", action="store_true",
                   help="register each run's models in the MLflow registry (off in sweeps: runs still log them)")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--partitions", default="data/partitions", help="partitions folder")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=cmd_sweep)


def cmd_sweep(args) -> int:
    from flows.sweep_plan import parse_grid, plan_sweep, stack_of
    from flows.sweep_table import sweep_table

    stack = stack_of(args)
    plan = plan_sweep(args.config, parse_grid(args.grid), args.seeds, args.overrides, args.params)
    from flows.sweep_run import run_sweep, sweep_summary  # Prefect, MLflow and torch load once the plan is valid

    result = run_sweep(plan, Path(args.sweep_dir) if args.sweep_dir else None, args.tracking_uri, args.partitions,
                       args.parallel, args.name, register_models=args.register_models,
                       progress=not args.no_progress and args.parallel == 1,
                       stack=stack)
    summary = sweep_summary(result)
    base = plan.base
    print(f"\n{base.name}: {len(plan.children)} runs ({len(summary['combinations'])} combinations × "
          f"{len(plan.seeds)} seeds) in {result.wall_s:.1f} s; fixed cost per run (outside its rounds) "
          f"{summary['fixed_s_per_run_median'] or float('nan'):.2f} s median\n")
    print(sweep_table(plan))
    print(f"\nsweep directory {result.sweep_dir}" + (f"; MLflow parent run {result.parent_run_id} "
                                                    f"(flockfl report {result.parent_run_id})" if result.parent_run_id else ""))
    if result.failed:
        print(f"flockfl: {len(result.failed)} of {len(plan.children)} runs failed: "
              + "; ".join(f"{c.key}: {c.error}" for c in result.failed)
              + ". Run the same command again to retry them.", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, default=str))
    return 1 if result.failed else 0
