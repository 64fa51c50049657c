"""``flockfl``: run, resume, partition, list and browse experiments.

Every user error (bad config, missing data, corrupt checkpoint, unknown run) exits with
code 2 and one line on stderr. Unexpected errors exit 1 with one line; the traceback is
kept in ``<run-dir>/error.log`` (or printed with ``FLOCKFL_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flockfl.errors import UserError
from flows.env import configure_environment

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flockfl", description="Clustered and personalised federated learning pipelines.")
    p.add_argument("--verbose", action="store_true", help="show Prefect's logs")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (a params.yaml name or a YAML config)")
    run.add_argument("config", metavar="CONFIG_OR_NAME")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--run-dir", help="checkpoint directory (default runs/<experiment>-<time>)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --run-dir if it holds checkpoints of the same config "
                          "(a changed config moves the old run aside and starts afresh)")
    _common(run)

    res = sub.add_parser("resume", help="continue a killed run from its last checkpoint")
    res.add_argument("run", metavar="RUN_DIR_OR_MLFLOW_RUN_ID")
    _common(res, config=False)

    part = sub.add_parser("partition", help="build and save a partition (data/partitions/<name>.npz + .json)")
    part.add_argument("name", metavar="PARTITION_OR_CONFIG", help="a partition or experiment in params.yaml, or a YAML config")
    part.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    part.add_argument("--params", default="params.yaml")
    part.add_argument("--out", default="data/partitions", help="partitions folder")
    part.add_argument("--json", action="store_true")

    ui = sub.add_parser("ui", help="open the MLflow UI on 127.0.0.1 against the run store")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--tracking-uri")
    ui.add_argument("--workers", type=int, default=1, help="MLflow server worker processes (default 1)")

    lst = sub.add_parser("list", help="experiments in params.yaml, the registered algorithms and the stages; "
                                      "flockfl list ALGORITHM shows its paper, hyper-parameters and stages; "
                                      "flockfl list curriculum|pruning shows that stage's keys")
    lst.add_argument("algorithm", nargs="?", metavar="ALGORITHM")
    lst.add_argument("--params", default="params.yaml")
    lst.add_argument("--json", action="store_true")
    lst.add_argument("--markdown", action="store_true", help="the algorithm table of docs/algorithms.md")
    # commands that live in their own modules: each module's add_parser(sub) registers its
    # subcommand(s) and sets ``handler`` (args -> int exit code); the modules stay light at import
    from flows import repro, report, schedule, server, sweep

    for mod in (sweep, repro, report, schedule, server):
        mod.add_parser(sub)
    return p


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--partitions", default="data/partitions", help="partitions folder")
    p.add_argument("--no-progress", action="store_true")
    if config:
        p.add_argument("--params", default="params.yaml")
        p.add_argument("--metrics-file", help="also write the final metrics here (for DVC)")


# ---------------------------------------------------------------------- commands


def cmd_run(args) -> dict:
    from flockfl.experiments import load_experiment
    from flockfl.state import list_checkpoints

    from flows.rundir import read_run_file, run_identity

    cfg = load_experiment(args.config, args.overrides, args.params)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{cfg.name}-{stamp}")
    if list_checkpoints(run_dir):
        if not args.resume:
            raise UserError(f"{run_dir} already holds checkpoints; continue it with: flockfl resume {run_dir}")
        if run_identity(read_run_file(run_dir).get("config")) != run_identity(cfg.model_dump()):
            # --resume with a changed config (e.g. a DVC stage whose params changed): keep the
            # old run beside it, never delete it, and start afresh
            archived = run_dir.with_name(f"{run_dir.name}.{stamp}")
            run_dir.rename(archived)
            print(f"flockfl: config changed; previous run moved to {archived}", file=sys.stderr)
    return _execute(cfg, run_dir, args, fresh=not list_checkpoints(run_dir))


def _execute(cfg, run_dir: Path, args, fresh: bool) -> dict:
    from flows.experiment import execute

    return execute(cfg, run_dir, tracking_uri=args.tracking_uri, partitions_root=args.partitions, fresh=fresh,
                   progress=not args.no_progress, metrics_file=getattr(args, "metrics_file", None))


def cmd_resume(args) -> dict:
    from flockfl.experiments import validate
    from flows.rundir import find_run_dir, read_run_file

    run_dir = find_run_dir(args.run, args.tracking_uri)
    info = read_run_file(run_dir)
    if "config" not in info:
        raise UserError(f"{run_dir}/run.json has no config; it was not written by flockfl run")
    cfg = validate(info["config"])
    args.tracking_uri = args.tracking_uri or info.get("tracking_uri")
    args.partitions = info.get("partitions_root", args.partitions)
    args.metrics_file = info.get("metrics_file")
    return _execute(cfg, run_dir, args, fresh=False)


def cmd_partition(args) -> dict:
    from flockfl.errors import ConfigError
    from flockfl.experiments import load_experiment, load_partition_config, load_params
    from flockfl.data.store import build_partition, summary

    params = load_params(args.params)
    if args.name in (params.get("partitions") or {}):
        cfg = load_partition_config(args.name, args.params)
        if args.overrides:
            from flockfl.config import deep_merge
            from flockfl.experiments import parse_set, validate

            cfg = validate(deep_merge(cfg.model_dump(), parse_set(args.overrides)))
    else:
        try:
            cfg = load_experiment(args.name, args.overrides, args.params)
        except ConfigError as err:
            known = ", ".join(sorted(params.get("partitions") or {})) or "none"
            raise ConfigError(f"{err} (partitions: {known})") from None
    ds, part, path, cached = build_partition(cfg, args.out)
    s = summary(part, ds)
    return {"partition": str(path), "cached": cached, "content_hash": part.content_hash,
            "num_clients": s["num_clients"], "size_stats": s["size_stats"], "label_skew_tv": s.get("label_skew_tv")}


def cmd_ui(args) -> None:
    from tasks.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri, None)
    # one worker and no job runner: a UI for one person answers in seconds instead of ~45 s on 2
    # cores (MLflow's default starts 4 uvicorn workers and a background job executor)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(args.port), "--backend-store-uri", uri,
           "--workers", str(args.workers)]
    env = {**os.environ}
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    from tasks.tracking import ui_url

    # the link opens MLflow 3's training view (runs and charts), not its GenAI (traces) view
    print(f"MLflow UI on {ui_url(f'http://127.0.0.1:{args.port}')} (store {uri}); Ctrl-C to stop", flush=True)
    try:
        subprocess.run(cmd, check=False, env=env)
    except KeyboardInterrupt:
        pass


def cmd_list(args) -> dict:
    from flockfl.algorithms import ALGORITHMS, describe
    from flockfl.data.datasets import LOADERS
    from flockfl.data.schemes import SCHEMES
    from flockfl.experiments import load_params
    from flockfl.reference import describe_stage
    from flockfl.stages import STAGES
    from models import MODELS

    stages = [cls.name for cls in STAGES]
    if args.algorithm:
        if args.algorithm in stages:
            return describe_stage(args.algorithm)
        if args.algorithm not in ALGORITHMS:
            raise UserError(f"unknown algorithm or stage {args.algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}, "
                            f"or a stage: {', '.join(stages)}")
        return describe(args.algorithm)

    params = load_params(args.params)
    return {
        "experiments": sorted(params.get("experiments") or {}),
        "partitions": sorted(params.get("partitions") or {}),
        "algorithms": sorted(ALGORITHMS),
        "datasets": list(LOADERS),
        "schemes": list(SCHEMES),
        "models": list(MODELS),
        "stages": stages,
    }


# ---------------------------------------------------------------------- output


def _print_summary(s: dict) -> None:
    m = s.get("metrics", {})
    rows = [("experiment", s.get("experiment")), ("rounds", s.get("rounds"))]
    rows += [(k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in m.items()]
    rows += [("engine", s.get("engine")), ("round_s_median", f"{s.get('round_s_median', float('nan')):.3f}"),
             ("wall_s", f"{s.get('wall_s', 0):.1f}"), ("run_dir", s.get("run_dir")), ("mlflow run", s.get("run_id")),
             ("state_sha256", (s.get("state_sha256") or "")[:16] + "…")]
    width = max(len(str(k)) for k, _ in rows)
    for k, v in rows:
        print(f"  {str(k).ljust(width)}  {v}")
    if s.get("target_accuracy") is not None:
        hit = s.get("rounds_to_target")
        print(f"  {'target'.ljust(width)}  accuracy {s['target_accuracy']}: "
              + (f"reached at round {hit}, sim_time {s['sim_time_to_target']:.1f}s" if hit else "not reached"))
    if s.get("clients_dropped"):
        print(f"  {'dropped'.ljust(width)}  {s['clients_dropped']} client trainings failed and were dropped")
    for w in s.get("checkpoint_warnings", []):
        print(f"  warning: {w}")
    from tasks.tracking import ui_url

    print(f"Browse it: flockfl ui --tracking-uri {s.get('tracking_uri')}  (then open {ui_url('http://127.0.0.1:5000')})")


def _print_algorithm(d: dict) -> None:
    print(f"{d['name']}: {d['paper']}")
    print(f"stages it overrides: {', '.join(d['stages']) or 'none (FedAvg)'}")
    print("hyper-parameters (key, default, allowed, symbol, source of the default, meaning [which value, where]):")
    rows = [(h["key"], repr(h["default"]), h["allowed"], h["symbol"], h.get("source") or "–",
             h["meaning"] + (f" [{h['source_note']}]" if h.get("source_note") else "")) for h in d["hyperparameters"]]
    widths = [max(len(r[i]) for r in rows) for i in range(5)] if rows else []
    for r in rows:
        print("  " + "  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_environment(verbose=args.verbose)
    if args.command in ("run", "resume", "sweep") or (args.command == "repro" and not (args.list or args.dry_run)):
        # Prefect's API starts now, on the other core, while torch, MLflow and the data load
        from flows import apiserver

        apiserver.start()
    from flockfl.errors import FlockError
    from flows.apiserver import ApiServerError

    t0 = time.perf_counter()
    try:
        if args.command in ("run", "resume"):
            out = cmd_run(args) if args.command == "run" else cmd_resume(args)
            # the command's fixed cost: the process's whole life so far minus the rounds it ran
            out["process_wall_s"] = time.time() - _process_start()
            out["outside_rounds_s"] = out["process_wall_s"] - out.get("rounds_wall_s", 0.0)
            for w in out.get("checkpoint_warnings", []) if args.json else []:
                print(f"flockfl: warning: {w}", file=sys.stderr)
            if args.json:
                print(json.dumps(out, default=str))
            else:
                _print_summary(out)
        elif args.command == "partition":
            out = cmd_partition(args)
            print(json.dumps(out) if args.json else
                  f"partition {out['partition']} ({'cached' if out['cached'] else 'built'}): {out['num_clients']} clients, "
                  f"sizes {out['size_stats']}, sha256 {out['content_hash'][:16]}…")
        elif args.command == "ui":
            cmd_ui(args)
        elif getattr(args, "handler", None):
            return int(args.handler(args) or 0)
        elif args.command == "list":
            if args.markdown:
                from flockfl.algorithms import algorithm_table

                print(algorithm_table())
                return 0
            out = cmd_list(args)
            if args.json:
                print(json.dumps(out, default=str))
            elif args.algorithm:
                _print_algorithm(out)
            else:
                for k, v in out.items():
                    print(f"{k}: {', '.join(v) if v else '(none)'}")
    except (FlockError, ApiServerError) as err:
        print(f"flockfl: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flockfl: interrupted; continue with flockfl resume RUN_DIR", file=sys.stderr)
        return 130
    except Exception as err:  # unexpected: one line, traceback kept on disk
        if os.environ.get("FLOCKFL_DEBUG"):
            raise
        print(f"flockfl: error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
              f"(traceback in <run-dir>/error.log; FLOCKFL_DEBUG=1 shows it)", file=sys.stderr)
        return 1
    finally:
        if args.command in ("run", "resume") and os.environ.get("FLOCKFL_TIMING"):
            print(f"flockfl: {time.perf_counter() - t0:.1f}s in main", file=sys.stderr)
    return 0


def _process_start() -> float:
    """When this process started (the interpreter's start-up included), as a Unix time."""
    import psutil

    return psutil.Process().create_time()


def entry() -> None:
    """Console entry point: run, then skip the interpreter's teardown.

    Once the exit handlers ran (they stop Prefect's ephemeral API server and flush MLflow)
    and the streams are flushed, nothing is left to do; tearing down torch, MLflow and
    Prefect's module graphs would cost ~2 s of garbage collection per command.
    """
    import atexit

    rc = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    entry()
