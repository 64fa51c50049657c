"""``flockfl sweep``: every grid combination × seed of one experiment, in one process.

One Prefect API and one MLflow store serve every run; each run is a child MLflow run
(``mlflow.parentRunId``) of one parent run, tagged ``flockfl.sweep.combo`` (the grid
combination, e.g. ``train.lr=0.05``) and ``flockfl.seed``. The sweep lives in a directory
(``runs/sweep-<experiment>-<digest>``) whose ``sweep.json`` lists its runs; each run has its
own run directory inside it. Running the same command again continues the sweep: finished
runs are kept, interrupted ones resume from their checkpoints (bit-identical to an
uninterrupted run), the rest start.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

SWEEP_FILE = "sweep.json"

# (header, summary metric, format): the sweep table's columns, shown when any run has them
COLUMNS = [
    ("accuracy", "accuracy", ".3f"), ("p10", "accuracy_p10", ".3f"), ("after local training", "accuracy_finetuned", ".3f"),
    ("ARI", "ari", ".3f"), ("clusters", "num_clusters", ".1f"), ("MB sent", "mb_total", ".1f"),
    ("wall s", "wall_s", ".1f"),
]


def add_parser(sub) -> None:
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
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (threads sharing the cores)")
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


# ---------------------------------------------------------------------- the plan


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["train.lr=0.01,0.05", …]`` → ``[("train.lr", ["0.01", "0.05"]), …]`` (values stay text:
    ``--set`` parsing turns them into numbers, booleans or lists)."""
    from flockfl.errors import ConfigError

    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ConfigError(f"--grid {item!r}: write KEY=V1,V2 (e.g. --grid train.lr=0.01,0.05)")
        if key.strip() in {k for k, _ in out}:
            raise ConfigError(f"--grid {key.strip()} given twice; list all its values once: --grid {key.strip()}=V1,V2")
        out.append((key.strip(), vals))
    return out


@dataclass
class Child:
    """One run of the sweep: a grid combination at one seed."""

    label: str  # the combination, e.g. "train.lr=0.05 algorithm.k=2" ("base" without a grid)
    seed: int
    overrides: list[str]
    cfg: Any = None
    run_dir: Optional[Path] = None
    summary: Optional[dict] = None
    error: Optional[str] = None
    status: str = "pending"  # pending | finished | failed
    resumed: bool = False

    @property
    def key(self) -> str:
        return f"{self.label} seed={self.seed}"


@dataclass
class Plan:
    base: Any
    grid: list[tuple[str, list[str]]]
    seeds: list[int]
    children: list[Child] = field(default_factory=list)
    digest: str = ""


def plan_sweep(ref: str, grid: list[tuple[str, list[str]]], seeds: Optional[list[int]], overrides: list[str],
               params: str, variants: Optional[list[tuple[str, list[str]]]] = None) -> Plan:
    """Every child config, validated (a bad key or value is a one-line ConfigError before
    anything runs). ``variants`` ([(label, overrides)]) replaces the grid's cartesian product
    with named variants (benchmarks/compare.py: one per algorithm)."""
    from flockfl.experiments import load_experiment

    base = load_experiment(ref, overrides, params)
    seeds = list(dict.fromkeys(seeds)) if seeds else [base.seed]
    if variants is None:
        combos = itertools.product(*[[(k, v) for v in vals] for k, vals in grid]) if grid else [()]
        variants = [(" ".join(f"{k}={v}" for k, v in combo) or "base", [f"{k}={v}" for k, v in combo]) for combo in combos]
    plan = Plan(base, grid, seeds)
    for label, extra in variants:
        for seed in seeds:
            child = Child(label, seed, list(extra) + [f"seed={seed}"])
            child.cfg = load_experiment(ref, overrides + child.overrides, params)
            plan.children.append(child)
    keys = [c.cfg.digest() for c in plan.children]
    if len(set(keys)) < len(keys):
        from flockfl.errors import ConfigError

        raise ConfigError("two runs of the sweep have the same config; a --grid value repeats or overrides a --set")
    plan.digest = hashlib.sha256(json.dumps([[c.key, k] for c, k in zip(plan.children, keys)]).encode()).hexdigest()
    return plan


def _slug(text: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "._-=" else "_" for ch in text.replace(" ", ","))
    return keep.replace("=", "") or "base"


# ---------------------------------------------------------------------- running


@dataclass
class SweepResult:
    plan: Plan
    sweep_dir: Path
    parent_run_id: Optional[str]
    tracking_uri: str
    wall_s: float
    continued: bool

    @property
    def failed(self) -> list[Child]:
        return [c for c in self.plan.children if c.status == "failed"]


def run_sweep(plan: Plan, sweep_dir: Optional[Path] = None, tracking_uri: Optional[str] = None,
              partitions_root: str = "data/partitions", parallel: int = 1, parent_name: Optional[str] = None,
              experiment: Optional[str] = None, register_models: bool = False, progress: bool = False,
              log=lambda msg: print(msg, file=sys.stderr, flush=True), on_finished=None) -> SweepResult:
    """Run (or continue) every child of ``plan`` in this process; see the module docstring.
    ``on_finished(child)`` is called, from the thread that settled it, as each child this call
    runs finishes (``flockfl repro``'s time estimate)."""
    from flockfl.data.store import build_partition
    from flows.experiment import execute, settle
    from flows.interrupt import interrupted, sigint_seen, watch
    from flows.rundir import read_run_file
    from flockfl.state import list_checkpoints
    from flows.tracking.store import resolve_tracking_uri
    from flows.tracking.tracker import Tracker

    t0 = time.perf_counter()
    base = plan.base
    name = f"sweep-{base.name}-{plan.digest[:10]}"
    sweep_dir = Path(sweep_dir or Path("runs") / name)
    state = _read(sweep_dir)
    continued = bool(state)
    if state and state.get("digest") != plan.digest:
        from flockfl.errors import UserError

        raise UserError(f"{sweep_dir} holds another sweep (different experiment, grid or seeds); "
                        f"choose another folder (flockfl sweep --sweep-dir, flockfl repro --out) or remove it")
    uri = state.get("tracking_uri") or resolve_tracking_uri(tracking_uri, base.tracking.uri)
    experiment = experiment or base.tracking.experiment or base.name
    for child in plan.children:
        child.run_dir = sweep_dir / f"{_slug(child.label)}-seed{child.seed}"
        child.cfg = child.cfg.model_copy(update={"tracking": child.cfg.tracking.model_copy(update={
            "experiment": experiment, "register_model": register_models and child.cfg.tracking.register_model})})
    for child in plan.children:  # data errors are one line, before anything runs
        build_partition(child.cfg, partitions_root)
    sweep_dir.mkdir(parents=True, exist_ok=True)

    tracked = base.tracking.enabled
    parent = None
    if tracked:
        parent = Tracker(uri, experiment, parent_name or name, run_id=state.get("parent_run_id"),
                         params={"sweep.experiment": base.name, "sweep.grid": json.dumps(plan.grid),
                                 "sweep.seeds": " ".join(map(str, plan.seeds)), "sweep.runs": len(plan.children),
                                 "sweep.dir": str(sweep_dir.resolve())} if not state else None,
                         tags={"flockfl.sweep.dir": str(sweep_dir.resolve()), "flockfl.sweep.digest": plan.digest})
    state.update({"digest": plan.digest, "experiment": base.name, "grid": plan.grid, "seeds": plan.seeds,
                  "tracking_uri": uri, "parent_run_id": parent.run_id if parent else None,
                  "partitions_root": str(Path(partitions_root).resolve()),
                  "created": state.get("created") or dt.datetime.now().isoformat()})
    runs = state.setdefault("runs", {})
    lock = threading.Lock()

    def record(child: Child) -> None:
        with lock:
            runs[child.key] = {"label": child.label, "seed": child.seed, "run_dir": str(child.run_dir),
                               "status": child.status, "error": child.error,
                               "summary": _slim(child.summary) if child.summary else None}
            _write(sweep_dir, state)

    todo = []
    for child in plan.children:
        info = read_run_file(child.run_dir)
        prior = runs.get(child.key) or {}
        if info.get("finished") and prior.get("status") == "finished" and prior.get("summary"):
            child.status, child.summary = "finished", prior["summary"]  # kept as it was
        else:
            child.resumed = bool(list_checkpoints(child.run_dir))
            todo.append(child)
        record(child)
    if continued:
        log(f"sweep: continuing {sweep_dir}: {len(plan.children) - len(todo)} of {len(plan.children)} runs finished, "
            f"{sum(c.resumed for c in todo)} resume from checkpoints")
    else:
        log(f"sweep: {len(plan.children)} runs in {sweep_dir}" + (f", MLflow parent run {parent.run_id}" if parent else ""))

    tags = {"flockfl.sweep.dir": str(sweep_dir.resolve())}

    def fail(child: Child, err: Exception) -> None:  # one run failing does not stop the sweep; it is recorded
        if os.environ.get("FLOCKFL_DEBUG"):
            raise err
        child.status, child.summary = "failed", None
        child.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log(f"sweep: {child.key} failed: {child.error} (its run directory {child.run_dir} keeps error.log)")
        record(child)

    def run_child(child: Child) -> Optional[Child]:
        """Run ``child`` up to its end; its tracking (the model export) goes on in the background
        until :func:`settle_child`. Returns the child, or None if it failed."""
        t = time.perf_counter()
        try:
            fresh = not list_checkpoints(child.run_dir)
            child.summary = execute(child.cfg, child.run_dir, tracking_uri=uri, partitions_root=partitions_root, fresh=fresh,
                                    progress=progress, parent_run_id=parent.run_id if parent else None,
                                    run_tags={**tags, "flockfl.sweep.combo": child.label, "flockfl.seed": str(child.seed)},
                                    run_name=f"{base.name} {child.key}", wait=False)
            child.summary["sweep_wall_s"] = time.perf_counter() - t  # the run as the sweep saw it, set-up included
            return child
        except Exception as err:
            if interrupted(err):  # Ctrl-C: the sweep stops here, the run resumes next time (flows/interrupt.py)
                raise KeyboardInterrupt(f"sweep interrupted during {child.key}") from err
            fail(child, err)
            return None

    def settle_child(child: Optional[Child]) -> None:
        """Wait for ``child``'s tracking to close, then record it as finished (or failed)."""
        if child is None:
            return
        try:
            settle(child.summary)
        except Exception as err:
            fail(child, err)
            return
        child.status, child.error = "finished", None
        m = child.summary["metrics"]
        log(f"sweep: {child.key}: accuracy {m.get('accuracy', float('nan')):.4f}"
            + (f" (resumed from round {child.summary['resumed_from_round']})" if child.summary.get("resumed_from_round") else "")
            + f", {child.summary['sweep_wall_s']:.1f} s")
        record(child)
        if on_finished:
            on_finished(child)

    cap = None
    if parallel > 1 and not os.environ.get("FLOCKFL_MAX_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cap = os.environ["FLOCKFL_MAX_THREADS"] = str(max(1, cores // parallel))  # N runs share the cores
    guard = watch()  # a Ctrl-C is noted: it stops the sweep rather than failing the run it cut
    guard.__enter__()
    try:
        if parallel > 1 and len(todo) > 1:
            with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="flockfl-sweep") as pool:
                list(pool.map(lambda c: settle_child(run_child(c)), todo))
        else:  # each run's models export while the next run starts (at most one run closing at a
            # time); a thread records it the moment its export is done, so a kill of the sweep
            # later on finds it finished
            closing: Optional[tuple[threading.Thread, Optional[Child]]] = None
            for child in todo + [None]:
                if child and sigint_seen():  # a Ctrl-C that the last run absorbed: start nothing new
                    raise KeyboardInterrupt(f"sweep interrupted before {child.key}")
                done = run_child(child) if child else None
                if closing:
                    t = time.perf_counter()
                    closing[0].join()
                    if closing[1] and closing[1].status == "finished":  # what the sweep itself waited for it
                        closing[1].summary["sweep_wall_s"] += time.perf_counter() - t
                        record(closing[1])
                if done:
                    closing = (threading.Thread(target=settle_child, args=(done,), name="flockfl-sweep-settle"), done)
                    closing[0].start()
                else:
                    closing = None
    except BaseException:
        if parent:
            parent.finish("KILLED")
        raise
    finally:
        guard.__exit__(None, None, None)
        if cap:
            os.environ.pop("FLOCKFL_MAX_THREADS", None)
    result = SweepResult(plan, sweep_dir, parent.run_id if parent else None, uri, time.perf_counter() - t0, continued)
    if parent:
        table = sweep_table(plan)
        parent.log_dict(sweep_summary(result), "sweep/summary.json")
        parent.log_text(table, "sweep/summary.md")
        agg = aggregate(plan)
        parent.log_values({f"{_metric_key(label)}/{k}_mean": v["mean"] for label, row in agg.items()
                           for k, v in row["metrics"].items() if v["mean"] == v["mean"]}, step=0)
        parent.finish("FAILED" if result.failed else "FINISHED")
    return result


def _metric_key(label: str) -> str:
    """An MLflow metric name for a combination label (keys allow alphanumerics, _-. / and space)."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in label.replace("=", "_"))


def _slim(summary: dict) -> dict:
    """What sweep.json keeps of a run's summary (enough for the table and the report)."""
    keys = ("run_id", "run_dir", "rounds", "resumed_from_round", "metrics", "state_sha256", "wall_s", "rounds_wall_s",
            "round_s_median", "sweep_wall_s", "phases_s", "bytes_total", "clients_dropped", "rounds_to_target", "sim_time_to_target",
            "protocol")
    return {k: summary.get(k) for k in keys if k in summary}


def _read(sweep_dir: Path) -> dict:
    path = sweep_dir / SWEEP_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        from flockfl.errors import UserError

        raise UserError(f"{path} is not valid JSON (a torn write?); remove it to restart the sweep's bookkeeping "
                        f"(finished runs keep their run directories)") from None


def _write(sweep_dir: Path, state: dict) -> None:
    tmp = sweep_dir / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, sweep_dir / SWEEP_FILE)


# ---------------------------------------------------------------------- the table


def _values(child: Child) -> dict[str, float]:
    s = child.summary or {}
    m = dict(s.get("metrics") or {})
    m["mb_total"] = (s.get("bytes_total") or 0) / 1e6
    m["wall_s"] = s.get("wall_s")
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def aggregate(plan: Plan) -> dict[str, dict]:
    """Per combination: the seeds that finished and mean/std (sample std, ddof=1) of each column."""
    out: dict[str, dict] = {}
    for label in dict.fromkeys(c.label for c in plan.children):
        done = [c for c in plan.children if c.label == label and c.status == "finished"]
        vals = [_values(c) for c in done]
        row = {}
        for _, key, _ in COLUMNS:
            xs = [v[key] for v in vals if key in v and math.isfinite(v[key])]
            row[key] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                        "std": statistics.stdev(xs) if len(xs) > 1 else float("nan"), "n": len(xs)}
        out[label] = {"seeds": [c.seed for c in done], "metrics": row,
                      "failed": [c.seed for c in plan.children if c.label == label and c.status == "failed"]}
    return out


def sweep_table(plan: Plan) -> str:
    """Markdown: one row per combination, mean ± std over its seeds (columns any run has)."""
    from flows.render import markdown_table

    agg = aggregate(plan)
    cols = [c for c in COLUMNS if any(row["metrics"][c[1]]["n"] for row in agg.values())]
    rows = []
    for label, row in agg.items():
        cells = [label, f"{len(row['seeds'])}/{len(row['seeds']) + len(row['failed'])}"
                 if row["failed"] else str(len(row["seeds"]))]
        for _, key, fmt in cols:
            v = row["metrics"][key]
            if not v["n"]:
                cells.append("–")
            elif v["n"] == 1:
                cells.append(format(v["mean"], fmt))
            else:
                cells.append(f"{format(v['mean'], fmt)} ± {format(v['std'], fmt)}")
        rows.append(cells)
    return markdown_table(["combination", "seeds"] + [h for h, _, _ in cols], rows)


def sweep_summary(result: SweepResult) -> dict:
    children = result.plan.children
    done = [c for c in children if c.status == "finished" and c.summary]
    fresh = [c.summary for c in done if c.summary.get("rounds_wall_s") is not None and "sweep_wall_s" in c.summary]
    return {
        "sweep_dir": str(result.sweep_dir), "parent_run_id": result.parent_run_id, "tracking_uri": result.tracking_uri,
        "digest": result.plan.digest, "runs": len(children), "finished": len(done), "failed": len(result.failed),
        "continued": result.continued, "wall_s": result.wall_s,
        # what a run costs beyond its rounds inside the sweep (flow start, tracking, partition, models, plots)
        "fixed_s_per_run_median": (statistics.median([s["sweep_wall_s"] - s["rounds_wall_s"] for s in fresh])
                                   if fresh else None),
        "combinations": aggregate(result.plan),
        "children": {c.key: {"label": c.label, "seed": c.seed, "status": c.status, "error": c.error,
                             "run_dir": str(c.run_dir), "run_id": (c.summary or {}).get("run_id"),
                             "state_sha256": (c.summary or {}).get("state_sha256")} for c in children},
    }


# ---------------------------------------------------------------------- the command


def cmd_sweep(args) -> int:
    from flockfl.errors import ConfigError

    if args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: give a positive number of runs at a time")
    plan = plan_sweep(args.config, parse_grid(args.grid), args.seeds, args.overrides, args.params)
    result = run_sweep(plan, Path(args.sweep_dir) if args.sweep_dir else None, args.tracking_uri, args.partitions,
                       args.parallel, args.name, register_models=args.register_models,
                       progress=not args.no_progress and args.parallel == 1)
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
