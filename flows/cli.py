"""``flockfl``: run, resume, partition, list and browse experiments.

Every user error (bad config, missing data, corrupt checkpoint, unknown run) exits with
code 2 and one line on stderr. Unexpected errors exit 1 with one line; the traceback is
kept in ``<run-dir>/error.log`` (or printed with ``FLOCKFL_DEBUG=1``).

Here: the parser, ``run``, ``resume`` and ``partition``, and :func:`main`. The other commands
live in their own modules (``flockfl list``: flows/listing.py, ``flockfl sweep``: flows/sweep.py,
…); what ``flockfl run`` prints without ``--json``: flows/run_summary.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from pathlib import Path

from flockfl.errors import UserError
from flows.env import configure_environment

EXIT_USAGE = 2
# path options whose relative values are the user's (made absolute before flockfl moves to the
# project's root); their defaults stay relative, i.e. relative to the root
PATH_OPTIONS = ("params", "partitions", "run_dir", "metrics_file", "out", "sweep_dir", "runs_root")


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

    # commands that live in their own modules: each module's add_parser(sub) registers its
    # subcommand(s) and sets ``handler`` (args -> int exit code); the modules stay light at import
    from flows import listing, repro, report, schedule, server, sweep, ui

    for mod in (listing, sweep, repro, report, schedule, server, ui):
        mod.add_parser(sub)
    return p


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--partitions", default="data/partitions", help="partitions folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--wait", action="store_true",
                   help="return only when the models are exported and registered and the MLflow run is FINISHED "
                        "(what a resident flockfl otherwise finishes after the command returned; FLOCKFL_WAIT=1 "
                        "sets it for every command)")
    if config:
        p.add_argument("--params", default="params.yaml")
        p.add_argument("--metrics-file", help="also write the final metrics here (for DVC)")


# ---------------------------------------------------------------------- commands


def cmd_run(args) -> dict:
    from flockfl.experiments import load_experiment
    from flockfl.state import list_checkpoints

    from flows.rundir import read_run_file, run_identity

    if args.project_root is None and Path(args.config).suffix not in (".yaml", ".yml", ".json"):
        from flockfl.experiments import no_project_error

        raise no_project_error(what=f" to find the experiment {args.config!r}")
    cfg = load_experiment(args.config, args.overrides, args.params)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{cfg.name}-{stamp}")
    args.resolved_run_dir = run_dir
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
    from flows import resident
    from flows.experiment import execute

    wait = args.wait or os.environ.get("FLOCKFL_WAIT", "") not in ("", "0") or not resident.in_child()
    out = execute(cfg, run_dir, tracking_uri=args.tracking_uri, partitions_root=args.partitions, fresh=fresh,
                  progress=False if args.no_progress else ("stderr" if args.json else True),
                  metrics_file=getattr(args, "metrics_file", None), wait=wait)
    if not wait and out.get("run_id"):
        out["export"] = "background"  # the models: exported and registered after the command returned
    return out


def cmd_resume(args) -> dict:
    from flockfl.experiments import validate
    from flows.rundir import find_run_dir, read_run_file

    run_dir = find_run_dir(args.run, args.tracking_uri)
    args.resolved_run_dir = run_dir
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


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    from flows.interrupt import install_lock_safe_sigint

    install_lock_safe_sigint()  # a Ctrl-C never lands inside a lock's code (flows/interrupt.py)
    parser = _parser()
    args = parser.parse_args(argv)
    from flockfl.errors import FlockError

    try:  # before anything else: Prefect's home and every default path are the project's
        enter_project(parser, args)
    except FlockError as err:
        print(f"flockfl: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    configure_environment(verbose=args.verbose)
    if args.command in ("run", "resume", "sweep") or (args.command == "repro" and not (args.list or args.dry_run)):
        # Prefect's API starts now, on the other core, while torch, MLflow and the data load and
        # the config is checked (a config error stops it with the command: nothing is written)
        from flows import apiserver

        apiserver.start()
    if "prefect" in sys.modules:  # a resident's child: Prefect was imported in another environment
        from flows.env import reread_prefect_settings

        reread_prefect_settings()
    from flows.apiserver import ApiServerError

    t0 = time.perf_counter()
    try:
        if args.command in ("run", "resume"):
            out = cmd_run(args) if args.command == "run" else cmd_resume(args)
            # the command's fixed cost: the process's whole life so far minus the rounds it ran
            out["process_wall_s"] = time.time() - _process_start()
            out["outside_rounds_s"] = out["process_wall_s"] - out.get("rounds_wall_s", 0.0)
            out["resident"] = PROCESS_START is not None  # run by a resident flockfl (flows/resident.py)
            import resource  # the command's peak memory so far (a resident's child: its own, shared pages included)

            out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            for w in out.get("checkpoint_warnings", []) if args.json else []:
                print(f"flockfl: warning: {w}", file=sys.stderr)
            if args.json:
                print(json.dumps(out, default=str))
            else:
                from flows.run_summary import summary_lines

                print("\n".join(summary_lines(out)))
            if out.get("export") == "background":  # a resident's child: the client goes, the export goes on
                from flows import resident
                from flows.run_tracking import settle

                resident.detach(0)
                settle(out)
        elif args.command == "partition":
            out = cmd_partition(args)
            print(json.dumps(out) if args.json else
                  f"partition {out['partition']} ({'cached' if out['cached'] else 'built'}): {out['num_clients']} clients, "
                  f"sizes {out['size_stats']}, sha256 {out['content_hash'][:16]}…")
        elif getattr(args, "handler", None):
            return int(args.handler(args) or 0)
    except (FlockError, ApiServerError) as err:
        print(f"flockfl: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted(args)
    except BrokenPipeError:
        raise  # entry() leaves quietly
    except Exception as err:  # unexpected: one line, the traceback kept on disk
        from flows.interrupt import from_keyboard_interrupt

        if from_keyboard_interrupt(err):  # a Ctrl-C that Prefect's crash handling turned into its own error
            return _interrupted(args)
        if os.environ.get("FLOCKFL_DEBUG"):
            raise
        log = _error_log(args)
        print(f"flockfl: error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
              f"(traceback in {log}; FLOCKFL_DEBUG=1 shows it)", file=sys.stderr)
        return 1
    finally:
        if args.command in ("run", "resume") and os.environ.get("FLOCKFL_TIMING"):
            print(f"flockfl: {time.perf_counter() - t0:.1f}s in main", file=sys.stderr)
    return 0


def _interrupted(args) -> int:
    hint = ("the same command again continues it (finished runs are kept, the cut one resumes)"
            if args.command in ("sweep", "repro") else "continue with flockfl resume RUN_DIR")
    print(f"flockfl: interrupted; {hint}", file=sys.stderr)
    return 130


def enter_project(parser: argparse.ArgumentParser, args) -> None:
    """Find the project as git and dvc find theirs, and work from its root.

    The root is the nearest folder upwards from the current one that holds a ``params.yaml``
    (or the folder of ``--params FILE``). Paths the user typed stay what they meant from where
    they typed them (made absolute); defaults (``params.yaml``, ``data/partitions``, ``runs/``,
    ``mlflow.db``, ``.prefect``) are the root's. Outside a project nothing moves; commands that
    need one say so in one line. ``args.project_root`` is the root or None."""
    from flockfl.errors import ConfigError
    from flockfl.experiments import find_project_root

    here = Path.cwd()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    for name in PATH_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value != sub.get_default(name):
            setattr(args, name, str((here / value).resolve()))
    uri = getattr(args, "tracking_uri", None)
    if uri and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        args.tracking_uri = "sqlite:///" + str((here / uri[len("sqlite:///"):]).resolve())
    for name in ("config", "name", "run", "experiment"):  # a file or folder typed on the command line
        value = getattr(args, name, None)
        if isinstance(value, str) and value and (here / value).exists() and not Path(value).is_absolute():
            setattr(args, name, str((here / value).resolve()))
    params = getattr(args, "params", None)
    explicit = isinstance(params, str) and params != sub.get_default("params")
    if explicit and not Path(params).is_file():
        raise ConfigError(f"--params {params}: no such file; give the path of a params.yaml")
    root = Path(params).parent if explicit else find_project_root(here)
    args.project_root = root
    if root is not None and root != here:
        os.chdir(root)


def _error_log(args) -> Path:
    """Where the traceback of an unexpected error went: the run's own error.log when the run
    wrote one, else a new file under the project's runs/errors/ (a temp folder outside a project)."""
    import tempfile
    import traceback

    run_dir = getattr(args, "resolved_run_dir", None)
    if run_dir is not None and (Path(run_dir) / "error.log").is_file():
        return (Path(run_dir) / "error.log").resolve()
    folder = Path("runs/errors") if getattr(args, "project_root", None) else Path(tempfile.gettempdir()) / "flockfl-errors"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{args.command}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text(traceback.format_exc())
    return path.resolve()


PROCESS_START: float | None = None  # a resident's child: when its client process started


def _process_start() -> float:
    """When this process started (the interpreter's start-up included), as a Unix time; in a
    resident's child, when the ``flockfl`` client it serves started."""
    if PROCESS_START is not None:
        return PROCESS_START
    from flows.resident import process_start

    return process_start()


def entry() -> None:
    """Console entry point: the resident runs the command (flows/resident.py), or this process
    does (:func:`run_and_finish`)."""
    from flows import resident

    rc = resident.forward(sys.argv[1:])
    if rc is not None:
        sys.stderr.flush()
        os._exit(rc)
    run_and_finish()


def run_and_finish(argv: list[str] | None = None) -> int:
    """Run the command, then skip the interpreter's teardown.

    Once the exit handlers ran (they stop Prefect's ephemeral API server and flush MLflow)
    and the streams are flushed, nothing is left to do; tearing down torch, MLflow and
    Prefect's module graphs would cost ~2 s of garbage collection per command. A reader that
    went away (``flockfl list | head``) ends the command quietly.
    """
    import atexit

    try:
        rc = main(argv)
    except BrokenPipeError:
        rc = 0
    # Prefect's workers drain their queues at exit and, on a loaded machine, log "Still processing
    # items" every 4 s meanwhile: progress of its own telemetry, not of the command (a one-line
    # error must stay one line)
    for name in ("EventsWorker", "APILogWorker"):
        logging.getLogger(name).setLevel(logging.ERROR)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader closed the pipe: nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    try:
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    from flows import resident

    if resident.pending_spawn:  # a plain command that found no resident: start one for the next
        resident.spawn(resident.pending_spawn)
    os._exit(rc)


if __name__ == "__main__":
    entry()
