"""``flockfl schedule``: experiments on a cron, on the Prefect server ``flockfl server`` starts
(:mod:`flows.server`).

``flockfl schedule EXPERIMENT --cron …`` registers a deployment of :data:`scheduled_experiment`
and serves it in the foreground with a Prefect ``Runner`` (what ``flow.serve`` does), so each
run executes in a subprocess of this command, on this machine, where the data and the run
directories are. Each scheduled run resumes the last run of the same config if it was cut off,
and starts a new one otherwise:

    runs/scheduled/<experiment>-<config digest[:12]>/<YYYYmmddTHHMMSS>/

The module stays light at import (the CLI imports it for every command): Prefect is imported
inside functions, and the flow object is built on first access (module ``__getattr__``).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import Any, Optional

from flockfl.errors import UserError
from flows.apiserver import healthy

FLOW_NAME = "flockfl-scheduled"
TAG = "flockfl"
STAMP = "%Y%m%dT%H%M%S"


# ---------------------------------------------------------------------- the scheduled flow


def schedule_root(runs_root: str | Path, cfg) -> Path:
    """Where the runs of one config live: ``<runs_root>/<experiment>-<digest[:12]>``."""
    return Path(runs_root) / f"{cfg.name}-{cfg.digest()[:12]}"


def latest_run_dir(root: Path) -> Optional[Path]:
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")) if Path(root).is_dir() else []
    return dirs[-1] if dirs else None


def resume_or_start(root: Path) -> tuple[Path, bool]:
    """``(run_dir, fresh)``: the most recent run under ``root`` if it holds checkpoints and did
    not finish (a run cut off by a crash, a reboot or Ctrl-C), else a new timestamped one."""
    from flockfl.state import list_checkpoints

    from flows.rundir import read_run_file

    last = latest_run_dir(root)
    if last is not None and list_checkpoints(last) and not read_run_file(last).get("finished"):
        return last, False
    stamp = dt.datetime.now().strftime(STAMP)
    run_dir, n = root / stamp, 1
    while run_dir.exists():  # two runs in one second
        run_dir, n = root / f"{stamp}.{n}", n + 1
    return run_dir, True


def run_scheduled(experiment: str, overrides: Optional[list[str]] = None, params: str = "params.yaml",
                  tracking_uri: Optional[str] = None, partitions_root: str = "data/partitions",
                  runs_root: str = "runs/scheduled", config_digest: Optional[str] = None, log=print) -> dict:
    """One scheduled run: resolve the config, then resume the last cut-off run of it or start
    a new one, through ``flockfl run``'s own path (``flows.experiment.execute``). Returns its summary
    plus ``scheduled_action`` (``resumed``, ``started`` or ``skipped``) and ``run_dir``."""
    import fcntl

    from flockfl.experiments import load_experiment
    from flockfl.state import list_checkpoints

    from flows.experiment import execute
    from flows.rundir import read_run_file

    cfg = load_experiment(experiment, overrides or [], params)
    if config_digest and cfg.digest() != config_digest:
        log(f"the config of {experiment!r} changed since it was scheduled (digest {config_digest[:12]} → "
            f"{cfg.digest()[:12]}); running the current one in its own folder")
    root = schedule_root(runs_root, cfg)
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / ".lock", "w")
    try:
        try:  # a run still going (a slow run and a frequent cron) keeps its folder to itself
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"skipped: the previous run of {cfg.name} in {root} is still running")
            return {"scheduled_action": "skipped", "run_dir": str(latest_run_dir(root)), "experiment": cfg.name}
        run_dir, fresh = resume_or_start(root)
        if fresh:
            log(f"started a new run of {cfg.name} in {run_dir}")
        else:
            info = read_run_file(run_dir)
            n = len(list_checkpoints(run_dir))
            log(f"resuming the unfinished run of {cfg.name} in {run_dir} "
                f"({n} checkpoint(s), created {info.get('created', '?')})")
            tracking_uri = tracking_uri or info.get("tracking_uri")
        summary = execute(cfg, run_dir, tracking_uri=tracking_uri, partitions_root=partitions_root, fresh=fresh, progress=False)
        summary.update(scheduled_action="started" if fresh else "resumed", run_dir=str(run_dir))
        resumed = f" (resumed from round {summary['resumed_from_round']})" if not fresh else ""
        log(f"{cfg.name}: {summary['rounds']} rounds done in {run_dir}{resumed}; "
            f"accuracy {summary['metrics'].get('accuracy', float('nan')):.4f}, MLflow run {summary.get('run_id')}")
        return summary
    finally:
        lock.close()


def _scheduled_body(experiment: str, overrides: Optional[list[str]] = None, params: str = "params.yaml",
                    tracking_uri: Optional[str] = None, partitions_root: str = "data/partitions",
                    runs_root: str = "runs/scheduled", config_digest: Optional[str] = None):
    from prefect import get_run_logger
    from prefect.states import Completed

    from flows.env import configure_environment

    configure_environment()  # the runner starts each run in a fresh process
    logger = get_run_logger()
    out = run_scheduled(experiment, overrides, params, tracking_uri, partitions_root, runs_root, config_digest,
                        log=logger.info)
    if out["scheduled_action"] == "skipped":
        return Completed(name="Skipped", message=f"the previous run in {out['run_dir']} is still running", data=out)
    return out


def _make_flow():
    from prefect import flow

    def scheduled_experiment(experiment: str, overrides: Optional[list[str]] = None, params: str = "params.yaml",
                             tracking_uri: Optional[str] = None, partitions_root: str = "data/partitions",
                             runs_root: str = "runs/scheduled", config_digest: Optional[str] = None) -> Any:
        """A scheduled flockfl experiment: resume its last cut-off run, or start a new one.

        The experiment itself runs as the ``flockfl-experiment`` subflow, one task per stage per round."""
        return _scheduled_body(experiment, overrides, params, tracking_uri, partitions_root, runs_root, config_digest)

    return flow(name=FLOW_NAME, persist_result=False, log_prints=True)(scheduled_experiment)


def __getattr__(name: str):
    # ``flows.schedule.scheduled_experiment`` (the deployment's entrypoint) builds the flow on
    # first use, so that importing this module does not import Prefect
    if name == "scheduled_experiment":
        globals()[name] = _make_flow()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------- flockfl schedule


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = (PREFECT_API_URL.value() or "").rstrip("/")
    if not url:
        raise UserError("flockfl schedule needs a Prefect server: start one with `flockfl server` and "
                          "export PREFECT_API_URL=http://127.0.0.1:4200/api")
    if not healthy(url, timeout=5):
        raise UserError(f"no Prefect server answers at PREFECT_API_URL={url}; start one with `flockfl server` "
                          f"(or fix PREFECT_API_URL)")
    return url


def _ui_url(api_url: str) -> str:
    from prefect.settings import PREFECT_UI_URL

    return (PREFECT_UI_URL.value() or api_url.removesuffix("/api")).rstrip("/")


def ui_link(ui_url: str, path: str) -> str:
    """``ui_url + path`` in the UI a browser gets by default: Prefect 3.8 serves its classic UI at
    ``/`` and the new one at ``/v2`` (the default, per its ``/ui-settings``)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=5) as r:
            settings = json.loads(r.read())
        base = settings.get(f"{settings.get('default_ui', 'v1')}_base_url") or "/"
    except Exception:
        base = "/"
    return f"{ui_url}{base.rstrip('/')}{path}"


def _local_timezone() -> str:
    try:
        import tzlocal

        name = tzlocal.get_localzone_name()
        if name:
            return name
    except Exception:
        pass
    return "UTC"


def cron_schedule(cron: str, timezone: Optional[str]):
    """Prefect's own cron schedule (what its scheduler expands), or a one-line error."""
    from pydantic import ValidationError

    from prefect.server.schemas.schedules import CronSchedule

    try:
        return CronSchedule(cron=cron, timezone=timezone)
    except ValidationError as err:
        msg = err.errors()[0].get("msg", str(err)).removeprefix("Value error, ")
        raise UserError(f"--cron {cron!r} / --timezone {timezone!r}: {msg}; "
                          f"e.g. --cron '0 3 * * *' (03:00 every day)") from None


def next_run(sched) -> Optional[dt.datetime]:
    import asyncio

    dates = asyncio.run(sched.get_dates(n=1))
    return dates[0] if dates else None


def _deployments(client) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import DeploymentSort

    # limit and sort explicitly: the sync client sends null for both, which the API rejects
    return client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])), limit=200,
                                   sort=DeploymentSort.NAME_ASC)


def _next_flow_run(client, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState, \
        FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    scheduled = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                 flow_run_filter=FlowRunFilter(state=scheduled),
                                 sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)
    return runs[0] if runs else None


def _next_from_cron(schedules) -> Optional[dt.datetime]:
    """The earliest next time of a deployment's active cron schedules (None if it has none)."""
    from prefect.server.schemas.schedules import CronSchedule

    times = [next_run(CronSchedule(cron=s.schedule.cron, timezone=s.schedule.timezone))
             for s in schedules if getattr(s, "active", True) and hasattr(s.schedule, "cron")]
    return min((t for t in times if t), default=None)


def _fmt_time(t) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if t else "-"


def cmd_list(api_url: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deps = sorted(_deployments(client), key=lambda d: d.name)
        if not deps:
            print(f"no flockfl schedules on {api_url}")
            return 0
        rows = []
        for d in deps:
            crons = [f"{s.schedule.cron} ({s.schedule.timezone or 'UTC'})" for s in d.schedules if hasattr(s.schedule, "cron")]
            nxt = _next_flow_run(client, d.id)
            # the scheduler service makes the runs on its own loop (each minute): before it has, the cron says when
            when = nxt.expected_start_time if nxt else None if d.paused else _next_from_cron(d.schedules)
            served = str(getattr(d.status, "value", d.status) or "").lower() == "ready"
            rows.append((d.name, (d.parameters or {}).get("experiment", "?"), ", ".join(crons) or "-",
                         "next " + _fmt_time(when),
                         ("paused" if d.paused else "active") + ("" if served else ", not served")))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            print("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    return 0


def cmd_delete(name: str, api_url: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deps = _deployments(client)
        match = [d for d in deps if d.name == name]
        if not match:
            known = ", ".join(sorted(d.name for d in deps)) or "none"
            raise UserError(f"no flockfl schedule named {name!r} on {api_url} (known: {known}); see flockfl schedule --list")
        for d in match:
            client.delete_deployment(d.id)
    print(f"deleted schedule {name} (its future runs too; past runs stay in the UI)")
    return 0


def _log_to_ui() -> None:
    """Scheduled runs log to the Prefect UI: turn on what flockfl's quiet defaults switch off,
    unless the user exported other values."""
    from flows.env import DEFAULTS

    for key, value in (("PREFECT_LOGGING_LEVEL", "INFO"), ("PREFECT_LOGGING_TO_API_ENABLED", "true")):
        if os.environ.get(key) == DEFAULTS.get(key):
            os.environ[key] = value


def cmd_schedule(args) -> int:
    _log_to_ui()  # before Prefect is imported
    if args.list and args.delete:
        raise UserError("--list and --delete go alone; use one of them")
    if args.list or args.delete:
        if args.experiment:
            raise UserError(f"--{'list' if args.list else 'delete'} takes no EXPERIMENT (got {args.experiment!r})")
        api = _api_url()
        return cmd_list(api) if args.list else cmd_delete(args.delete, api)
    if not args.experiment or not args.cron:
        raise UserError("flockfl schedule needs EXPERIMENT and --cron, e.g. flockfl schedule demo --cron '0 3 * * *' "
                          "(or --list / --delete NAME)")

    from flockfl.experiments import load_experiment
    from flows.tracking.store import resolve_tracking_uri

    # everything the run needs, resolved here: it runs later, in another process
    cfg = load_experiment(args.experiment, args.overrides, args.params)
    tz = args.timezone or _local_timezone()
    sched = cron_schedule(args.cron, tz)
    api = _api_url()
    experiment = str(Path(args.experiment).resolve()) if Path(args.experiment).is_file() else args.experiment
    parameters = {
        "experiment": experiment,
        "overrides": list(args.overrides),
        "params": str(Path(args.params).resolve()),
        "tracking_uri": resolve_tracking_uri(args.tracking_uri, cfg.tracking.uri),
        "partitions_root": str(Path(args.partitions).resolve()),
        "runs_root": str(Path(args.runs_root).resolve()),
        "config_digest": cfg.digest(),
    }
    name = args.name or f"{cfg.name}-{cfg.digest()[:8]}"
    return serve(name, sched, parameters, api, cfg)


def serve(name: str, sched, parameters: dict, api: str, cfg) -> int:
    """Register the deployment and run its scheduled runs until Ctrl-C (which pauses it)."""
    import asyncio

    from prefect.runner import Runner
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    from flows import schedule as this

    runner = Runner(name=name, pause_on_shutdown=True)

    def _on_sigterm(signum, frame):  # Prefect's own handler calls an async stop() without awaiting it
        raise KeyboardInterrupt

    runner.handle_sigterm = _on_sigterm  # start() installs self.handle_sigterm
    deployment_id = runner.add_flow(
        this.scheduled_experiment, name=name, schedules=[Cron(sched.cron, timezone=sched.timezone)],
        parameters=parameters, tags=[TAG, f"experiment:{cfg.name}"],
        description=f"flockfl experiment {cfg.name} (config sha256 {cfg.digest()[:12]}), "
                    f"runs in {schedule_root(parameters['runs_root'], cfg)}",
        entrypoint_type=EntrypointType.MODULE_PATH)
    ui = _ui_url(api)
    print(f"Serving schedule {name} (flow {FLOW_NAME}, experiment {cfg.name}); Ctrl-C stops and pauses it.\n"
          f"  cron:     {sched.cron} ({sched.timezone})\n"
          f"  next run: {_fmt_time(next_run(sched))}\n"
          f"  runs in:  {schedule_root(parameters['runs_root'], cfg)}/<time>/ (an unfinished one is resumed)\n"
          f"  MLflow:   {parameters['tracking_uri']}\n"
          f"  UI:       {ui_link(ui, f'/deployments/deployment/{deployment_id}')}", flush=True)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, SystemExit):
        pass
    print(f"flockfl: stopped serving {name}; its schedule is paused (run the same flockfl schedule command to go on)",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- argparse


def add_parser(sub) -> None:
    sch = sub.add_parser("schedule", help="run an experiment on a cron schedule (served here, shown in the Prefect UI); "
                                          "--list / --delete NAME manage schedules",
                         description="Registers a deployment of the experiment on the Prefect server at PREFECT_API_URL "
                                     "and runs its scheduled runs here until Ctrl-C. A run resumes the last unfinished "
                                     "run of the same config, or starts a new one.")
    sch.add_argument("experiment", nargs="?", metavar="CONFIG_OR_NAME")
    sch.add_argument("--cron", help="a cron string, e.g. '0 3 * * *' (03:00 every day)")
    sch.add_argument("--timezone", help="IANA time zone of the cron (default: this machine's)")
    sch.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    sch.add_argument("--params", default="params.yaml")
    sch.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    sch.add_argument("--partitions", default="data/partitions", help="partitions folder")
    sch.add_argument("--runs-root", default="runs/scheduled", help="where the scheduled runs live")
    sch.add_argument("--name", help="deployment name (default <experiment>-<config digest[:8]>)")
    sch.add_argument("--list", action="store_true", help="list the flockfl schedules on the server")
    sch.add_argument("--delete", metavar="NAME", help="delete a schedule (and its future runs)")
    sch.set_defaults(handler=cmd_schedule)
