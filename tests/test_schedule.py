"""`flockfl server` and `flockfl schedule`, for real: a Prefect server with its UI, a cron
deployment served by `flockfl schedule`, its run (with the experiment as a subflow of per-round
task runs) in the Prefect API and in MLflow, and the run's page in the Prefect UI rendered by
a headless Chromium. Plus resume-or-start of scheduled runs, without a server.

The live part waits for the next minute boundary (the cron is "* * * * *"). To spend that
wait usefully, the server and the schedule start in the background as soon as this module's
tests begin (when a selected test needs them), while the server-less test runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, assert_not_blank, browse, flock_env, free_port, needs_chromium, run_flock, tiny_config

ROUNDS = 3
TINY = tiny_config(name="sched", train={"rounds": ROUNDS}, tracking={"enabled": True, "register_model": False})
STAGES = ("select", "train_shard", "cluster", "aggregate", "evaluate", "checkpoint")


def project(d: Path, name: str = "sched") -> Path:
    (d / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (d / f"{name}.yaml").write_text(yaml.safe_dump({**TINY, "name": name}))
    return d


# ---------------------------------------------------------------------- without a server


@pytest.mark.slow  # a killed scheduled run, its resume and a new one (49 s in the parallel suite): the full suite's, not the fast tier's
def test_scheduled_run_resumes_a_cut_off_run_then_starts_anew(tmp_path):
    """The scheduled flow (called here as a flow, on the ephemeral API): the latest run of its
    config was SIGKILLed at round 2, so it resumes it in place; the next one starts anew."""
    import fcntl

    from flockfl.experiments import load_experiment

    from flows.rundir import read_run_file
    from flows.schedule import run_scheduled, schedule_root, scheduled_experiment

    d = project(tmp_path)
    uri = f"sqlite:///{d}/mlflow.db"
    kw = dict(experiment=str(d / "sched.yaml"), params=str(d / "params.yaml"), tracking_uri=uri,
              partitions_root=str(d / "data/partitions"), runs_root=str(d / "runs/scheduled"))
    cfg = load_experiment(kw["experiment"], [], kw["params"])
    root = schedule_root(kw["runs_root"], cfg)
    assert root.name == f"sched-{cfg.digest()[:12]}"
    cut = root / "20200101T000000"
    res = run_flock(["run", "sched.yaml", "--run-dir", str(cut), "--tracking-uri", uri, "--json"], d,
                    env={"FLOCKFL_CRASH_AT": "2:train"})
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert not read_run_file(cut).get("finished")

    # a run still going holds the folder's lock: the next firing leaves it alone
    with open(root / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert run_scheduled(**kw)["scheduled_action"] == "skipped"

    first = scheduled_experiment(**kw)
    assert first["scheduled_action"] == "resumed" and first["run_dir"] == str(cut)
    assert first["resumed_from_round"] == 2 and first["rounds"] == ROUNDS
    assert read_run_file(cut)["finished"] and read_run_file(cut)["mlflow_run_id"] == first["run_id"]

    second = scheduled_experiment(**kw)
    assert second["scheduled_action"] == "started" and second["resumed_from_round"] == 0
    new = Path(second["run_dir"])
    assert new.parent == root and new != cut and read_run_file(new)["finished"]
    assert second["run_id"] != first["run_id"]
    # a finished run is never picked up again, and the two runs of one config agree
    assert second["state_sha256"] == first["state_sha256"]


def test_schedule_errors_are_one_line(tmp_path):
    d = project(tmp_path)
    env = {"PREFECT_API_URL": ""}
    bad = run_flock(["schedule", "sched.yaml", "--cron", "61 * * * *"], d, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Invalid cron string" in bad.stderr, bad.stderr
    noapi = run_flock(["schedule", "sched.yaml", "--cron", "0 3 * * *"], d, env=env)
    assert noapi.returncode == 2 and noapi.stderr.count("\n") == 1, noapi.stderr
    assert "flockfl server" in noapi.stderr and "export PREFECT_API_URL=" in noapi.stderr


# ---------------------------------------------------------------------- a live server


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


class Live:
    """`flockfl server` and `flockfl schedule` as real subprocesses, each in its own session with
    its output in files; started in a thread so that the server-less tests run meanwhile."""

    def __init__(self, d: Path):
        self.dir = project(d)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.url}/api"
        self.uri = f"sqlite:///{d}/mlflow.db"
        self.env = flock_env({"PREFECT_HOME": str(d / "prefect-home"), "PREFECT_API_URL": self.api})
        self.procs: dict[str, subprocess.Popen] = {}
        self.error: BaseException | None = None
        self.scheduled_at = None
        self._done = None
        self.thread = threading.Thread(target=self._start, daemon=True)
        self.thread.start()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        out = open(self.dir / f"{name}.out", "w")
        err = open(self.dir / f"{name}.err", "w")
        p = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=self.dir, env=self.env, stdout=out,
                             stderr=err, text=True, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return "".join((self.dir / f"{name}.{s}").read_text() for s in ("out", "err") if (self.dir / f"{name}.{s}").exists())

    def _start(self):
        try:
            server = self._spawn("server", ["server", "--port", str(self.port)])
            t0 = time.monotonic()
            while "export PREFECT_API_URL" not in self.log("server"):
                assert server.poll() is None, f"flockfl server exited:\n{self.log('server')}"
                assert time.monotonic() - t0 < 150, f"flockfl server not ready in 150 s:\n{self.log('server')}"
                time.sleep(0.5)
            assert _get(f"{self.api}/health") is True
            self.server_ready_s = time.monotonic() - t0
            sched = self._spawn("schedule", ["schedule", "sched.yaml", "--cron", "* * * * *", "--tracking-uri", self.uri])
            while "UI:" not in self.log("schedule"):
                assert sched.poll() is None, f"flockfl schedule exited:\n{self.log('schedule')}"
                assert time.monotonic() - t0 < 200, f"flockfl schedule did not start serving:\n{self.log('schedule')}"
                time.sleep(0.5)
            self.scheduled_at = time.monotonic()
        except BaseException as err:  # re-raised in the test that waits for it
            self.error = err

    def ready(self) -> "Live":
        self.thread.join(timeout=300)
        if self.error:
            raise self.error
        assert self.scheduled_at, "the server and the schedule did not start"
        return self

    def deployment(self) -> dict:
        deps = _post(f"{self.api}/deployments/filter", {"flows": {"name": {"any_": ["flockfl-scheduled"]}}})
        assert len(deps) == 1, deps
        return deps[0]

    def completed_run(self) -> dict:
        """The first scheduled run, once COMPLETED (≤ 150 s after the schedule was served)."""
        if self._done:
            return self._done
        self.ready()
        dep = self.deployment()
        while True:
            runs = _post(f"{self.api}/flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}},
                                                         "sort": "EXPECTED_START_TIME_ASC", "limit": 20})
            bad = [r for r in runs if r["state_type"] in ("FAILED", "CRASHED")]
            assert not bad, f"scheduled run {bad[0]['name']} {bad[0]['state_type']}:\n{self.log('schedule')[-3000:]}"
            done = [r for r in runs if r["state_type"] == "COMPLETED"]
            if done:
                self._done = done[0]
                self.wait_s = time.monotonic() - self.scheduled_at
                return self._done
            assert self.procs["schedule"].poll() is None, f"flockfl schedule exited:\n{self.log('schedule')[-3000:]}"
            assert time.monotonic() - self.scheduled_at < 150, (
                f"no COMPLETED run within 150 s: {[(r['name'], r['state_type']) for r in runs]}\n{self.log('schedule')[-3000:]}")
            time.sleep(2)

    def subflow(self, run: dict) -> dict:
        subs = _post(f"{self.api}/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}})
        assert len(subs) == 1, subs
        return subs[0]

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return _post(f"{self.api}/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})

    def stop(self):
        for name in ("schedule", "server"):  # the schedule first: stopping it pauses its deployment
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


_LIVE: dict[str, Live] = {}


@pytest.fixture(scope="module", autouse=True)
def _start_live_early(request, tmp_path_factory):
    """Start the server and the schedule now if a selected test of this module needs them."""
    mine = [i for i in request.session.items if i.module is request.module]
    if any("live" in i.fixturenames for i in mine):
        _LIVE["live"] = Live(tmp_path_factory.mktemp("live"))
    yield
    if "live" in _LIVE:
        _LIVE.pop("live").stop()


@pytest.fixture
def live():
    return _LIVE["live"].ready()


def test_list_says_when_the_cron_fires_before_the_scheduler_made_a_run():
    """`flockfl schedule --list` right after serving: the scheduler service (a one-minute loop) may not
    have made a run yet; the next time then comes from the cron itself, not "-" (a CI flake once)."""
    import datetime as dt
    from types import SimpleNamespace

    from flows.schedule import _next_from_cron

    def sched(cron, active=True):
        return SimpleNamespace(active=active, schedule=SimpleNamespace(cron=cron, timezone="UTC"))

    now = dt.datetime.now(dt.timezone.utc)
    hourly = _next_from_cron([sched("0 * * * *")])
    assert hourly.minute == 0 and dt.timedelta(0) < hourly - now <= dt.timedelta(hours=1), hourly
    every = _next_from_cron([sched("0 * * * *"), sched("* * * * *")])  # the earliest of two
    assert dt.timedelta(0) < every - now <= dt.timedelta(minutes=1), every
    assert _next_from_cron([sched("* * * * *", active=False)]) is None
    assert _next_from_cron([SimpleNamespace(active=True, schedule=SimpleNamespace(interval=60))]) is None


@pytest.mark.slow
def test_flock_schedule_runs_the_experiment_on_the_server(live):
    run = live.completed_run()
    print(f"server ready in {live.server_ready_s:.0f}s; first scheduled run COMPLETED {live.wait_s:.0f}s after "
          f"the schedule was served ({run['name']}, expected start {run['expected_start_time']})")
    dep = live.deployment()
    from flockfl.experiments import load_experiment

    cfg = load_experiment(str(live.dir / "sched.yaml"), [], str(live.dir / "params.yaml"))
    assert dep["name"] == f"sched-{cfg.digest()[:8]}" and dep["paused"] is False
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["* * * * *"]
    assert dep["parameters"]["experiment"] == str(live.dir / "sched.yaml") and "flockfl" in dep["tags"]
    assert run["auto_scheduled"] and run["deployment_id"] == dep["id"]

    # the experiment ran as a subflow, one task run per stage per round
    sub = live.subflow(run)
    assert sub["state_type"] == "COMPLETED"
    flow = _get(f"{live.api}/flows/{sub['flow_id']}")
    assert flow["name"] == "flockfl-experiment"
    deadline = time.monotonic() + 30  # task-run states are recorded from events, a moment later
    while True:
        tasks = live.task_runs(sub["id"])
        names = [t["name"].rsplit("-", 1)[0] for t in tasks]
        if all(t["state_type"] == "COMPLETED" for t in tasks) and names.count("log_metrics") == ROUNDS \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    for stage in STAGES:
        assert names.count(stage) == ROUNDS, (stage, sorted(names))
    assert {"partition", "restore"} <= set(names)
    assert all(t["state_type"] == "COMPLETED" for t in tasks), sorted((t["name"], t["state_type"]) for t in tasks)

    # the run's log names what it did (the flow's logs reach the UI)
    logs = _post(f"{live.api}/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    assert any("started a new run of sched in" in m["message"] for m in logs), [m["message"] for m in logs]

    # its run folder, and MLflow's run of it
    root = live.dir / "runs/scheduled" / f"sched-{cfg.digest()[:12]}"
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    info = json.loads((dirs[0] / "run.json").read_text())
    assert info["finished"] and len(list((dirs[0] / "checkpoints").glob("ckpt-*.pt"))) >= 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(live.uri)
    mrun = client.get_run(info["mlflow_run_id"])
    assert mrun.info.status == "FINISHED"
    assert client.get_experiment(mrun.info.experiment_id).name == "sched"
    assert sorted(m.step for m in client.get_metric_history(mrun.info.run_id, "accuracy")) == list(range(1, ROUNDS + 1))


@pytest.mark.slow
@needs_chromium
def test_prefect_ui_shows_the_scheduled_run_and_its_task_runs(live, tmp_path):
    run = live.completed_run()
    dep = live.deployment()
    sub = live.subflow(run)
    settings = _get(f"{live.url}/ui-settings")  # Prefect 3.8: classic UI at /, the new (default) one at /v2
    base = live.url + settings[f"{settings['default_ui']}_base_url"].rstrip("/")

    # the scheduled run's page: its name, its deployment, the experiment subflow, the log line
    png = tmp_path / "scheduled-run.png"
    dom = browse(f"{base}/runs/flow-run/{run['id']}?tab=Logs", png)
    print(f"screenshot: {png}")
    assert_not_blank(png)
    assert run["name"] in dom and dep["name"] in dom and "flockfl-scheduled" in dom
    assert "started a new run of sched" in dom and "Completed" in dom

    # the experiment subflow's page with its task runs listed
    png2 = tmp_path / "experiment-task-runs.png"
    dom2 = browse(f"{base}/runs/flow-run/{sub['id']}?tab=TaskRuns", png2)
    print(f"screenshot: {png2}")
    assert_not_blank(png2)
    assert "flockfl-experiment" in dom2 and run["name"] in dom2  # the parent run is linked
    # the list is paged, newest first: it counts them all and names the last round's
    tasks = sorted(live.task_runs(sub["id"]), key=lambda t: t["start_time"] or "")
    assert f"{len(tasks)} Task runs" in dom2
    last = {t["name"].rsplit("-", 1)[0]: t["name"] for t in tasks}  # the latest of each task
    missing = [last[stage] for stage in STAGES if last[stage] not in dom2]
    assert not missing, missing
    if os.environ.get("FLOCKFL_KEEP_SCREENSHOTS"):
        for p in (png, png2):
            shutil.copy(p, Path(os.environ["FLOCKFL_KEEP_SCREENSHOTS"]) / p.name)


@pytest.mark.slow
def test_list_and_delete_schedules(live):
    live.ready()
    name = live.deployment()["name"]
    env = {"PREFECT_API_URL": live.api, "PREFECT_HOME": live.env["PREFECT_HOME"]}
    lst = run_flock(["schedule", "--list"], live.dir, env=env)
    assert lst.returncode == 0, lst.stderr
    print(lst.stdout)
    line = next(ln for ln in lst.stdout.splitlines() if ln.startswith(name))
    assert "sched.yaml" in line and "* * * * *" in line and "next 20" in line and line.rstrip().endswith("active"), line

    unknown = run_flock(["schedule", "--delete", "nosuch"], live.dir, env=env)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and f"known: {name}" in unknown.stderr, unknown.stderr
    busy = run_flock(["server", "--port", str(live.port)], live.dir, env=env)
    assert busy.returncode == 2 and "in use" in busy.stderr, busy.stderr

    gone = run_flock(["schedule", "--delete", name], live.dir, env=env)
    assert gone.returncode == 0 and f"deleted schedule {name}" in gone.stdout, gone.stderr
    assert _post(f"{live.api}/deployments/filter", {}) == []
    after = run_flock(["schedule", "--list"], live.dir, env=env)
    assert after.returncode == 0 and "no flockfl schedules" in after.stdout, after.stdout + after.stderr

