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
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

TABLES_DIR = Path(__file__).resolve().parents[1] / "configs" / "repro"
KEYS = {"title", "paper", "notes", "base", "rows", "columns", "budgets", "default_budget", "seeds", "conventions",
        "published", "tolerance", "scale"}


def add_parser(sub) -> None:
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
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (threads sharing the cores)")
    p.add_argument("--out", help="the table's folder (default runs/repro/<table>-<budget>[-<overrides digest>]"
                                 "[-part-<digest of the --rows/--columns chosen>])")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--partitions", default="data/partitions", help="partitions folder")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=cmd_repro)


# ---------------------------------------------------------------------- tables


@dataclass
class Table:
    name: str
    title: str
    paper: str
    base: dict
    rows: dict[str, dict]
    columns: dict[str, dict]
    budgets: dict[str, dict]
    default_budget: str
    seeds: list[int]
    conventions: list[dict]
    published: dict[str, dict]
    tolerance: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    scale: float = 100.0


def table_names() -> list[str]:
    return sorted(p.stem for p in TABLES_DIR.glob("*.yaml"))


def load_table(name: str) -> Table:
    """A table from configs/repro/, checked: a problem is one line naming the file and the fix."""
    from flockfl.errors import ConfigError
    from flockfl.experiments import read_mapping

    path = TABLES_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown table {name!r}; choose one of {', '.join(table_names())} (flockfl repro --list)")
    raw = read_mapping(path, "describing a table")
    unknown = set(raw) - KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(KEYS))}")
    for key in ("title", "paper", "base", "rows", "budgets"):
        if key not in raw:
            raise ConfigError(f"{path}: missing {key!r}")
    budgets = raw["budgets"]
    default = raw.get("default_budget", "paper")
    if default not in budgets:
        raise ConfigError(f"{path}: default_budget {default!r} is not one of the budgets ({', '.join(budgets)})")
    conventions = raw.get("conventions") or [{"label": "accuracy", "metric": "accuracy"}]
    t = Table(name=name, title=raw["title"], paper=raw["paper"], base=raw["base"], rows=dict(raw["rows"]),
              columns=dict(raw.get("columns") or {"": {}}), budgets=budgets, default_budget=default,
              seeds=list(raw.get("seeds") or [0, 1, 2]), conventions=conventions,
              published=raw.get("published") or {}, tolerance=raw.get("tolerance") or {},
              notes=list(raw.get("notes") or []), scale=float(raw.get("scale", 100.0)))
    labels = [c["label"] for c in t.conventions]
    for r, row in t.rows.items():
        if "compare" in row and row["compare"] not in labels:
            raise ConfigError(f"{path}: rows.{r}.compare is {row['compare']!r}, not a convention's label; "
                              f"choose one of: {'; '.join(labels)}")
        bad = set(row.get("only_columns") or ()) - set(t.columns)
        if bad:
            raise ConfigError(f"{path}: rows.{r}.only_columns names column(s) {', '.join(sorted(bad))} not in columns")
    for source, cells in t.published.items():
        for row, cols in cells.items():
            if row not in t.rows:
                raise ConfigError(f"{path}: published.{source} names row {row!r}, which is not in rows")
            bad = set(cols) - set(t.columns)
            if bad:
                raise ConfigError(f"{path}: published.{source}.{row} names column(s) {', '.join(sorted(bad))} not in columns")
    return t


def as_overrides(mapping: Optional[dict]) -> list[str]:
    """A nested config mapping as ``--set`` items (values as YAML, so lists and null survive)."""
    from flockfl.config import flatten

    out = []
    for key, value in flatten(mapping or {}).items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
        out.append(f"{key}={text.removesuffix(chr(10) + '...')}")
    return out


def _pick(labels: dict, wanted: Optional[list[str]], what: str, table: str) -> list[str]:
    from flockfl.errors import ConfigError

    if not wanted:
        return list(labels)
    missing = [w for w in wanted if w not in labels]
    if missing:
        raise ConfigError(f"--{what} {', '.join(missing)}: not in table {table!r}; its {what}: {', '.join(labels)}")
    return [label for label in labels if label in wanted]


def cell_label(row: str, col: str) -> str:
    return f"{row} | {col}" if col else row


@dataclass
class ReproPlan:
    table: Table
    budget: str
    rows: list[str]
    cols: list[str]
    overrides: list[str]
    out: Path
    base_file: Path
    sweep: Any = None  # flows.sweep_plan.Plan

    def cells(self) -> list[tuple[str, str, list[str]]]:
        t = self.table
        budget = as_overrides(t.budgets[self.budget])
        return [(r, c, budget + as_overrides(t.columns[c]) + as_overrides(row_config(t.rows[r])) + self.overrides)
                for r in self.rows for c in self.cols if has_cell(t, r, c)]


ROW_KEYS = ("only_columns", "compare")  # a row's keys that are the table's, not the run's config


def row_config(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ROW_KEYS}


def compared(t: Table, row: str) -> str:
    """The convention whose value is compared with the published numbers in ``row``."""
    return t.rows[row].get("compare") or t.conventions[0]["label"]


def has_cell(t: Table, row: str, col: str) -> bool:
    only = t.rows[row].get("only_columns")
    return only is None or col in only


def plan_repro(name: str, budget: Optional[str], seeds: Optional[list[int]], rows: Optional[list[str]],
               cols: Optional[list[str]], overrides: list[str], params: str, out: Optional[str] = None) -> ReproPlan:
    """Every cell × seed, validated before anything runs (a bad cell is a one-line ConfigError)."""
    from flockfl.errors import ConfigError
    from flows.sweep_plan import plan_sweep

    t = load_table(name)
    budget = budget or t.default_budget
    if budget not in t.budgets:
        raise ConfigError(f"--budget {budget!r}: table {name!r} has budgets {', '.join(t.budgets)}")
    picked_rows, picked_cols = _pick(t.rows, rows, "rows", name), _pick(t.columns, cols, "columns", name)
    tag = f"{name}-{budget}"
    if overrides:
        tag += "-" + hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:8]
    if picked_rows != list(t.rows) or picked_cols != list(t.columns):
        # a part of the table is its own sweep (its grid differs): its own folder, so the same
        # command continues it and neither the whole table's folder nor another part's refuses it
        part = json.dumps([picked_rows, picked_cols])
        tag += "-part-" + hashlib.sha256(part.encode()).hexdigest()[:8]
    folder = Path(out) if out else Path("runs") / "repro" / tag
    folder.mkdir(parents=True, exist_ok=True)
    base_file = folder / "base.yaml"
    base = {"name": f"repro-{name}", **t.base}
    text = yaml.safe_dump(base, sort_keys=False)
    if not base_file.exists() or base_file.read_text() != text:
        base_file.write_text(text)
    plan = ReproPlan(t, budget, picked_rows, picked_cols, list(overrides), folder, base_file)
    variants = [(cell_label(r, c), over) for r, c, over in plan.cells()]
    # the --set items shape the base (what the header describes) and win over every cell's own settings
    plan.sweep = plan_sweep(str(base_file), [], seeds or t.seeds, list(overrides), params, variants=variants)
    return plan


# ---------------------------------------------------------------------- before it runs


def count_line(plan: ReproPlan) -> str:
    """How much the table is: cells, seeds and runs at the chosen budget."""
    t = plan.table
    cells, runs = len(plan.cells()), len(plan.sweep.children)
    seeds = len(plan.sweep.seeds)
    default = " (the table's default)" if plan.budget == t.default_budget else ""
    others = [b for b in t.budgets if b != plan.budget]
    return (f"{cells} cell{'s' * (cells != 1)} × {seeds} seed{'s' * (seeds != 1)} = {runs} run{'s' * (runs != 1)} at "
            f"budget '{plan.budget}'{default}" + (f"; other budgets: {', '.join(others)} (--budget)" if others else "")
            + "; the time the table needs is printed when its first run is done")


def _data_problem(ds) -> Optional[str]:
    """Why a cell's dataset cannot be loaded (one line with the fix), or None. Only the files
    are looked for (the loader's own search: ``dataset.path``, ``data/raw/<name>/``, the Debian
    package's folder); generated and bundled datasets always load."""
    from flockfl.data.datasets import SYSTEM_DIRS, _find_idx_dir, default_mix_sources
    from flockfl.errors import ConfigError

    try:
        if ds.name in SYSTEM_DIRS:
            _find_idx_dir(ds.name, ds.path)
        elif ds.name == "mix":
            for source in ds.sources if ds.sources is not None else default_mix_sources(ds.path):
                if source in SYSTEM_DIRS:
                    _find_idx_dir(source, str(Path(ds.path) / source) if ds.path else None)
        elif ds.name == "npz" and not Path(ds.path or "").is_file():
            return f"npz: no file {ds.path!r}; set dataset.path (--set dataset.path=FILE.npz) to an existing .npz"
    except ConfigError as err:
        return str(err)
    return None


def missing_data(plan: ReproPlan) -> Optional[str]:
    """One line naming the first dataset a cell needs and cannot find, the cells that need it,
    and the fix; None when every cell's data is there."""
    needs: dict[str, list[str]] = {}
    problems: dict[str, str] = {}
    for child in plan.sweep.children:
        ds = child.cfg.dataset
        key = json.dumps(ds.model_dump(include={"name", "path", "sources"}), sort_keys=True)
        if key not in problems:
            problems[key] = _data_problem(ds)
        if problems[key]:
            needs.setdefault(key, [])
            if child.label not in needs[key]:
                needs[key].append(child.label)
    if not needs:
        return None
    key, cells = next(iter(needs.items()))
    return (f"table {plan.table.name!r} cannot start: {len(cells)} of its {len(plan.cells())} cells need data that is "
            f"missing ({problems[key]})")


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


# ---------------------------------------------------------------------- results


def cell_values(plan: ReproPlan) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per cell, per convention label: the finished seeds' values (scaled, e.g. to percent)."""
    t = plan.table
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in plan.rows:
        for c in plan.cols:
            if not has_cell(t, r, c):
                continue
            label = cell_label(r, c)
            done = [ch for ch in plan.sweep.children if ch.label == label and ch.status == "finished" and ch.summary]
            vals = {}
            for conv in t.conventions:
                xs = [first_metric(summary_metrics(ch.summary), conv["metric"]) for ch in done]
                vals[conv["label"]] = [t.scale * float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
            out[(r, c)] = vals
    return out


def summary_metrics(summary: dict) -> dict:
    """A run's metrics, with every convention's ``accuracy`` under the run's report mode added
    by its logged name: ``summarise`` reports ``accuracy__label_union__clients__best`` for each
    mode; a column names ``accuracy__label_union__clients``, read under the run's own mode."""
    metrics = dict(summary.get("metrics") or {})
    mode = (summary.get("protocol") or {}).get("report")
    for key, value in list(metrics.items()):
        name, _, got = key.rpartition("__")
        if key.count("__") == 3 and got == mode:
            metrics.setdefault(name, value)
    return metrics


def first_metric(metrics: dict, keys) -> Optional[float]:
    """The first of ``keys`` (one name or a list) that the run reported."""
    for key in [keys] if isinstance(keys, str) else keys:
        if metrics.get(key) is not None:
            return metrics[key]
    return None


def _ms(xs: list[float]) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def _published(v: Any) -> Optional[float]:
    if v is None:
        return None
    return float(v[0]) if isinstance(v, (list, tuple)) else float(v)


def _pub_text(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, (list, tuple)):
        return f"{float(v[0]):.2f} ± {float(v[1]):.2f}" if len(v) > 1 and v[1] is not None else f"{float(v[0]):.2f}"
    return f"{float(v):.2f}"


def render(plan: ReproPlan) -> tuple[str, dict]:
    """The table as markdown (one row per method; per column, ours under each convention and each
    published source) and as JSON, with the within-tolerance counts against each source."""
    from flows.render import markdown_table

    t = plan.table
    vals = cell_values(plan)
    header = ["method"]
    for c in plan.cols:
        for conv in t.conventions:
            header.append(f"{c + ' ' if c else ''}ours: {conv['label']}")
        for source in t.published:
            header.append(f"{c + ' ' if c else ''}{source}")
    lines, cells_json = [], []
    star = len(t.conventions) > 1 and bool(t.published)  # mark the compared value where there is a choice
    hits = {s: [0, 0] for s in t.tolerance}
    for r in plan.rows:
        line = [r]
        for c in plan.cols:
            if not has_cell(t, r, c):
                line += ["·"] * (len(t.conventions) + len(t.published))
                continue
            v, first = vals[(r, c)], compared(t, r)
            line += [_ms(v[conv["label"]]) + ("*" if star and conv["label"] == first and v[first] else "")
                     for conv in t.conventions]
            cell = {"row": r, "column": c, "ours": {k: {"values": xs, "mean": statistics.fmean(xs) if xs else None}
                                                     for k, xs in v.items()}, "published": {}, "compared": first}
            for source, by_row in t.published.items():
                pub = (by_row.get(r) or {}).get(c)
                line.append(_pub_text(pub))
                cell["published"][source] = pub
                p, xs = _published(pub), v[first]
                if source in hits and p is not None and xs:
                    hits[source][1] += 1
                    hits[source][0] += abs(statistics.fmean(xs) - p) <= float(t.tolerance[source])
            cells_json.append(cell)
        lines.append(line)
    text = markdown_table(header, lines)
    if star:
        text += ("\n\n`*`: the convention compared with the published numbers (the first, or the row's own where its "
                 "paper's code measured that method another way)")
    within = {s: {"within": h[0], "of": h[1], "points": float(t.tolerance[s])} for s, h in hits.items()}
    return text, {"cells": cells_json, "within_tolerance": within}


def describe_setting(plan: ReproPlan) -> str:
    """One paragraph naming the data, model, budget and protocol every cell ran with."""
    from flockfl.config import deep_merge

    cfg = plan.sweep.base
    tr, ev = cfg.train, cfg.eval
    paper = deep_merge(plan.table.base, plan.table.budgets.get("paper", {})).get("train", {})
    ran = deep_merge(tr.model_dump(), plan.table.budgets[plan.budget].get("train", {}))  # the cells' budget
    tr = tr.model_copy(update={k: ran[k] for k in ("rounds", "local_epochs", "clients_per_round")})
    return (f"{cfg.dataset.name}, {cfg.partition.num_clients} clients, {tr.clients_per_round} per round, "
            f"{cfg.model.name}; {tr.rounds} rounds × {tr.local_epochs} local epochs (budget '{plan.budget}'; the "
            f"paper's: {paper.get('rounds', '?')} × {paper.get('local_epochs', '?')}), batch {tr.batch_size}, lr {tr.lr}, "
            f"momentum {tr.momentum}, weight decay {tr.weight_decay}; protocol: test_set={ev.test_set}, "
            f"average={ev.average}, report={ev.report}" + (f" (last_k={ev.last_k})" if ev.report == "mean_last" else "")
            + f"; seeds {' '.join(map(str, plan.sweep.seeds))}"
            + (f"; applied to every cell: {' '.join(plan.overrides)}" if plan.overrides else ""))


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
                       progress=not args.no_progress and args.parallel == 1, on_finished=on_finished)
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
