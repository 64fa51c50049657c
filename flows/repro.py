"""``flockfl repro TABLE``: one published table, run by flockfl and printed beside the paper's.

A table is a file ``configs/repro/<name>.yaml`` (``flockfl repro --list`` names them). It holds:

- ``title``, ``paper`` (the source of the published numbers) and ``notes`` (where and why ours
  may differ: budget, model, evaluation convention);
- ``base``: the experiment every cell starts from, with its ``eval`` protocol;
- ``rows`` (methods) and ``columns`` (data settings), each a label and the config it sets; the
  cells are their product (a row's ``only_columns`` restricts it to some columns, as when two
  of a paper's tables share a setting but not their rows);
- ``budgets``: ``paper`` (the paper's rounds, epochs, clients) and ``cpu`` (what a 2-core CPU
  runs in minutes to an hour), each a config mapping; the output names the one used;
- ``conventions``: the evaluation conventions printed, each a label and the summary metric it
  reads, or a list of metrics of which the first a run has (``accuracy_pruned`` before
  ``accuracy``: a pruned model where there is one); one run answers every convention (see
  ``eval`` in docs/config.md);
- ``published``: per source (the paper, an independent reproduction), per row and column, the
  number (percent), or [mean, std]; ``tolerance``: per source, the points within which ours
  should land (the table counts the cells that do). Ours is compared under the first
  convention, or under the one a row names in ``compare`` (a convention's label: where the
  paper's code measured that method another way, e.g. a cluster model as served); the compared
  value is marked ``*`` in the printed table.

Every cell × seed is one child run of ``flockfl sweep``'s machinery (flows/sweep_plan.py,
flows/sweep_run.py): one Prefect API and one MLflow store, the children nested under one MLflow
parent run, which also gets the table (``repro/table.md``, ``repro/table.json``). The same command
again continues it: finished cells are kept, interrupted ones resume from their checkpoints. Nothing
is tuned per table: the rows take the registry's defaults except where the paper states a value.

Before anything runs, the command prints the number of cells and runs at the chosen budget and
checks that the data of every cell is there (a missing dataset is one line naming it and the
fix); after the first run it starts afresh, it prints what that run took and the time the
table needs at that pace (:func:`estimate_line`).

Here: the command (:func:`add_parser`, :func:`cmd_repro`) and the time estimate. The table files:
flows/repro_tables.py; the plan and what is checked before anything runs: flows/repro_plan.py;
the printed table: flows/repro_render.py.
"""

from __future__ import annotations

import json
import sys
import threading

from flows.repro_plan import ReproPlan, count_line, missing_data, plan_repro
from flows.repro_render import describe_setting, render
from flows.repro_tables import load_table, table_names


def add_parser(sub) -> None:
    from flows.sweep_plan import add_run_options

    p = sub.add_parser("repro", help="run a published table (3 seeds, resumable) and print ours beside the paper's",
                       description="Run one table of configs/repro/ as a resumable sweep and print ours beside the "
                                   "published numbers, with the protocol and budget named. flockfl repro --list names "
                                   "the tables.")
    p.add_argument("table", nargs="?", metavar="TABLE")
    p.add_argument("--list", action="store_true", help="name the tables and what they reproduce")
    p.add_argument("--budget", help="one of the table's budgets: paper (the paper's rounds and epochs, in full), cpu "
                                    "(what fits a small CPU), or another the table defines (--list names them); "
                                    "default: the table's default_budget (paper for every table); the time the table "
                                    "needs at it is printed when its first run is done")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="seeds (default: the table's, 0 1 2)")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows (labels as printed)")
    p.add_argument("--columns", nargs="+", metavar="COLUMN", help="only these columns")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="applied to every cell (the output says so)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their configs; run nothing")
    add_run_options(p)
    p.add_argument("--out", help="the table's folder (default runs/repro/<table>-<budget>[-<overrides digest>]"
                                 "[-part-<digest of the --rows/--columns chosen>])")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--partitions", default="data/partitions", help="partitions folder")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=cmd_repro)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def estimate_line(plan: ReproPlan, child, done: int, left: int, parallel: int = 1) -> str:
    """After the first run this command started afresh: what it took, and the table's time at
    that pace (every run as long as this one, ``parallel`` at a time; cells differ by method and
    setting, so it is a first guess)."""
    took = float(child.summary.get("sweep_wall_s") or child.summary.get("wall_s") or 0.0)
    runs = len(plan.sweep.children)
    at_once = max(1, min(parallel, runs))
    line = (f"repro: run {done}/{runs} ({child.key}) took {_duration(took)}; at that pace the table needs about "
            f"{_duration(took * runs / at_once)} at budget '{plan.budget}'")
    if left:
        line += (f", {_duration(took * left / max(1, min(parallel, left)))} more for the {left} "
                 f"run{'s' * (left != 1)} left")
    return line + (f" ({at_once} at a time)" if at_once > 1 else "") + "; cells differ by method, so it is a first guess"


# ---------------------------------------------------------------------- the command


def cmd_repro(args) -> int:
    from flockfl.errors import UserError

    if args.list:
        for name in table_names():
            t = load_table(name)
            print(f"{name}: {t.title} ({len(t.rows)} rows × {len(t.columns)} columns, budgets "
                  f"{', '.join(t.budgets)}; default {t.default_budget})")
        if args.json:
            print(json.dumps({"tables": table_names()}))
        return 0
    if not args.table:
        raise UserError("name a table (flockfl repro TABLE) or list them (flockfl repro --list)")
    from flows.sweep_plan import stack_of

    stack = stack_of(args)
    plan = plan_repro(args.table, args.budget, args.seeds, args.rows, args.columns, args.overrides, args.params, args.out)
    t = plan.table
    missing = missing_data(plan)
    if missing and not args.dry_run:
        from flockfl.errors import ConfigError

        raise ConfigError(missing)
    print(f"\n## {t.title}\n\n{describe_setting(plan)}\n\n{count_line(plan)}\n", flush=True)
    if args.dry_run:
        for child in plan.sweep.children:
            print(f"- {child.key}: {' '.join(child.overrides)}")
        print(f"\ndata: {missing}" if missing else "\ndata: every cell's dataset is there")
        return 0
    from flows.sweep_run import run_sweep

    lock, estimated = threading.Lock(), []

    def on_finished(child) -> None:
        """The first run started afresh (not resumed) gives the estimate, once."""
        with lock:
            if estimated or child.resumed:
                return
            estimated.append(child.key)
            done = sum(c.status == "finished" for c in plan.sweep.children)
            left = sum(c.status == "pending" for c in plan.sweep.children)
            print(estimate_line(plan, child, done, left, args.parallel), file=sys.stderr, flush=True)

    result = run_sweep(plan.sweep, plan.out / "runs", args.tracking_uri, args.partitions, args.parallel,
                       f"repro {args.table} ({plan.budget})", experiment=f"repro-{args.table}",
                       progress=not args.no_progress and args.parallel == 1, on_finished=on_finished,
                       stack=stack)
    text, data = render(plan)
    notes = "\n".join(f"- {n}" for n in t.notes)
    within = "; ".join(f"{v['within']} of {v['of']} cells within ±{v['points']:g} points of {s}"
                       for s, v in data["within_tolerance"].items())
    report = (f"## {t.title}\n\nPublished: {t.paper}\n\n{describe_setting(plan)}\n\n{text}\n\n"
              + (f"{within}\n\n" if within else "") + (f"Where and why ours may differ:\n{notes}\n" if notes else ""))
    print(text + "\n")
    if within:
        print(within + "\n")
    if notes:
        print("Where and why ours may differ:\n" + notes + "\n")
    (plan.out / "table.md").write_text(report)
    summary = {"table": args.table, "budget": plan.budget, "seeds": plan.sweep.seeds, "out": str(plan.out),
               "parent_run_id": result.parent_run_id, "runs": len(plan.sweep.children),
               "failed": [c.key for c in result.failed], "protocol": plan.sweep.base.eval.model_dump(), **data}
    (plan.out / "table.json").write_text(json.dumps(summary, indent=1, default=str))
    if result.parent_run_id:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(result.tracking_uri)
        client.log_text(result.parent_run_id, report, "repro/table.md")
        client.log_dict(result.parent_run_id, summary, "repro/table.json")
        client.set_tag(result.parent_run_id, "flockfl.repro.table", args.table)
        client.set_tag(result.parent_run_id, "flockfl.repro.budget", plan.budget)
        print(f"table folder {plan.out}; MLflow parent run {result.parent_run_id} (flockfl report {result.parent_run_id})")
    if result.failed:
        print(f"flockfl: {len(result.failed)} of {len(plan.sweep.children)} runs failed: "
              + "; ".join(f"{c.key}: {c.error}" for c in result.failed)
              + ". Run the same command again to retry them.", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, default=str))
    return 1 if result.failed else 0
