"""`flockfl sweep` (one process, nested MLflow runs, resume after SIGKILL) and the per-process
Prefect API (it starts first, dies with a SIGKILLed flockfl): real flockfl processes, a real
Prefect API, a real MLflow SQLite store."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, flock_env, last_json, run_flock, tiny_config

pytestmark = pytest.mark.slow

# pickle: ~3 s less per flockfl process than pt2 (torch.export's imports)
CONFIG = tiny_config(name="sw", seed=0, algorithm={"name": "ifca", "k": 2, "init": "random"},
                     tracking={"enabled": True, "register_model": False, "model_format": "pickle"})


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    (d / "sw.yaml").write_text(yaml.safe_dump(CONFIG))
    (d / "long.yaml").write_text(yaml.safe_dump({**CONFIG, "name": "long", "train": {**CONFIG["train"], "rounds": 60}}))
    (d / "mid.yaml").write_text(yaml.safe_dump({**CONFIG, "name": "mid", "train": {**CONFIG["train"], "rounds": 20}}))
    return d


def uri(project) -> str:
    return f"sqlite:///{project}/mlflow.db"


def sweep_cmd(project, *extra) -> list[str]:
    return ["sweep", "sw.yaml", "--grid", "train.lr=0.05,0.1", "--seeds", "0", "1", "--tracking-uri", uri(project),
            "--json", *extra]


@pytest.fixture(scope="module")
def swept(project):
    res = run_flock(sweep_cmd(project, "--sweep-dir", "runs/grid"), project)
    assert res.returncode == 0, res.stderr
    return res


def test_sweep_prints_mean_std_per_combination(swept):
    s = last_json(swept.stdout)
    assert s["runs"] == 4 and s["finished"] == 4 and s["failed"] == 0 and not s["continued"]
    assert set(s["combinations"]) == {"train.lr=0.05", "train.lr=0.1"}
    rows = [line for line in swept.stdout.splitlines() if line.startswith("| train.lr=")]
    assert len(rows) == 2 and all("±" in r for r in rows)
    assert s["fixed_s_per_run_median"] is not None and s["fixed_s_per_run_median"] > 0


def test_sweep_runs_are_nested_mlflow_runs_with_tags(project, swept):
    from mlflow.tracking import MlflowClient

    s = last_json(swept.stdout)
    client = MlflowClient(uri(project))
    parent = client.get_run(s["parent_run_id"])
    assert parent.info.status == "FINISHED"
    kids = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(kids) == 4 and all(k.info.status == "FINISHED" for k in kids)
    combos = sorted((k.data.tags["flockfl.sweep.combo"], k.data.tags["flockfl.seed"]) for k in kids)
    assert combos == [("train.lr=0.05", "0"), ("train.lr=0.05", "1"), ("train.lr=0.1", "0"), ("train.lr=0.1", "1")]
    assert {k.data.params["train.lr"] for k in kids} == {"0.05", "0.1"} and {k.data.params["seed"] for k in kids} == {"0", "1"}
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert arts == {"sweep/summary.json", "sweep/summary.md"}
    for label, row in s["combinations"].items():
        accs = [k.data.metrics["accuracy"] for k in kids if k.data.tags["flockfl.sweep.combo"] == label]
        mean = sum(accs) / 2
        assert row["metrics"]["accuracy"]["mean"] == pytest.approx(mean)
        assert row["metrics"]["accuracy"]["std"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accs)))


def test_a_sweep_run_equals_the_same_flock_run(project, swept):
    """Sharing one process changes nothing: a child's state equals a separate `flockfl run`."""
    s = last_json(swept.stdout)
    res = run_flock(["run", "sw.yaml", "--set", "train.lr=0.1", "--set", "seed=1", "--run-dir", "runs/single",
                     "--json", "--tracking-uri", uri(project)], project)
    assert res.returncode == 0, res.stderr
    assert last_json(res.stdout)["state_sha256"] == s["children"]["train.lr=0.1 seed=1"]["state_sha256"]


def test_same_command_again_keeps_finished_runs(project, swept):
    s = last_json(swept.stdout)
    again = run_flock(sweep_cmd(project, "--sweep-dir", "runs/grid"), project)
    assert again.returncode == 0, again.stderr
    a = last_json(again.stdout)
    assert a["continued"] and a["parent_run_id"] == s["parent_run_id"]
    assert {k: c["run_id"] for k, c in a["children"].items()} == {k: c["run_id"] for k, c in s["children"].items()}
    assert "4 of 4 runs finished" in again.stderr


def test_parallel_sweep_runs_in_two_processes_with_the_same_runs(project, swept):
    """--parallel 2: this process and a worker process (flows/sweep_workers.py) take the jobs (two
    stacks of two cells); each run ends as in the sweep of one process, and the sweep's bookkeeping
    and MLflow runs are whole. (Runs one by one in two processes: the Ctrl-C test below.)"""
    from mlflow.tracking import MlflowClient

    s = last_json(swept.stdout)
    out = "runs/parallel"
    res = run_flock(sweep_cmd(project, "--sweep-dir", out, "--parallel", "2"), project)
    assert res.returncode == 0, res.stderr
    p = last_json(res.stdout)
    assert p["finished"] == 4 and p["failed"] == 0
    assert {k: c["state_sha256"] for k, c in p["children"].items()} == {k: c["state_sha256"] for k, c in s["children"].items()}
    runs = json.loads((project / out / "sweep.json").read_text())["runs"]
    assert {r["summary"]["worker"] for r in runs.values()} == {0, 1}  # both processes ran some
    assert all(r["summary"]["stack"]["cells"] == 2 for r in runs.values())
    client = MlflowClient(uri(project))
    kids = client.search_runs([client.get_run(p["parent_run_id"]).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{p['parent_run_id']}'")
    assert len(kids) == 4 and all(k.info.status == "FINISHED" for k in kids)
    assert all(len(client.search_logged_models([k.info.experiment_id], filter_string=f"source_run_id = '{k.info.run_id}'")) == 2
               for k in kids)  # each run's two cluster models, exported in the process that ran it


def test_bad_grid_is_one_line(project):
    for grid, needle in (("train.lr", "KEY=V1,V2"), ("train.nonsense=1,2", "nonsense")):
        res = run_flock(["sweep", "sw.yaml", "--grid", grid, "--tracking-uri", uri(project)], project)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("flockfl: error:") and needle in lines[0], res.stderr


def _popen_flock(args, cwd: Path, out, per_process: bool = False):
    # SIGINT as a terminal leaves it (a pytest-xdist worker ignores it, and its children would too)
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=flock_env(per_process=per_process),
                            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@contextlib.contextmanager
def _flock_process(args, cwd: Path, per_process: bool = False):
    """``flockfl ARGS`` in its own session; whatever is left of its process group is killed after the block."""
    with tempfile.TemporaryFile("w+") as out:
        proc = _popen_flock(args, cwd, out, per_process)
        try:
            yield proc
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _sigkill_when(args, cwd: Path, pred, timeout: float = 240) -> None:
    """Run ``flockfl ARGS`` and SIGKILL it once ``pred()`` holds."""
    with _flock_process(args, cwd) as proc:
        _wait_for(pred, timeout, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_for(pred, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"flockfl exited ({proc.returncode}) before the condition held")
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_killed_sweep_resumes_from_checkpoints(project):
    """Runs one by one (``--no-stack``): SIGKILL the sweep during its second run, once the first is finished (its models exported
    while the second started); the same command again keeps the first run as it was and resumes
    the second from its checkpoint, bit-identical to an uninterrupted run."""
    cmd = ["sweep", "mid.yaml", "--seeds", "0", "1", "--sweep-dir", "runs/killed", "--tracking-uri", uri(project), "--json",
           "--no-stack"]
    second = project / "runs/killed/base-seed1/checkpoints"

    def first_finished() -> bool:
        try:
            return json.loads((project / "runs/killed/sweep.json").read_text())["runs"]["base seed=0"]["status"] == "finished"
        except (OSError, ValueError, KeyError):
            return False

    _sigkill_when(cmd, project, lambda: first_finished() and len(list(second.glob("ckpt-*.pt"))) >= 3)
    first = project / "runs/killed/base-seed0"
    state = json.loads((project / "runs/killed/sweep.json").read_text())
    assert state["runs"]["base seed=0"]["status"] == "finished" and state["runs"]["base seed=1"]["status"] == "pending"
    first_ckpts = {p.name: p.stat().st_mtime_ns for p in (first / "checkpoints").glob("ckpt-*.pt")}

    res = run_flock(cmd, project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["continued"] and s["finished"] == 2 and s["parent_run_id"] == state["parent_run_id"]
    assert "1 of 2 runs finished, 1 resume from checkpoints" in res.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (first / "checkpoints").glob("ckpt-*.pt")} == first_ckpts
    final = json.loads((project / "runs/killed/sweep.json").read_text())["runs"]["base seed=1"]["summary"]
    assert final["resumed_from_round"] >= 2

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    kids = client.search_runs([client.get_run(s["parent_run_id"]).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{s['parent_run_id']}'")
    assert len(kids) == 2 and all(k.info.status == "FINISHED" for k in kids)  # the resumed run kept its MLflow run

    ref = run_flock(["run", "mid.yaml", "--set", "seed=1", "--run-dir", "runs/mid-ref", "--json",
                     "--tracking-uri", uri(project)], project)
    assert ref.returncode == 0, ref.stderr
    assert last_json(ref.stdout)["state_sha256"] == s["children"]["base seed=1"]["state_sha256"]


def test_killed_stacked_sweep_resumes_every_cell_bit_for_bit(project):
    """The default: the two seeds train together as cells of one stack (flows/stack.py). SIGKILL the
    sweep once both cells have checkpoints and neither has finished; the same command again resumes
    both from their own checkpoints into their MLflow runs, and each ends in the state of the same
    run alone (``flockfl run``)."""
    cmd = ["sweep", "mid.yaml", "--seeds", "0", "1", "--sweep-dir", "runs/stack-killed", "--tracking-uri", uri(project),
           "--json"]
    ckpts = [project / f"runs/stack-killed/base-seed{i}/checkpoints" for i in (0, 1)]
    _sigkill_when(cmd, project, lambda: all(len(list(c.glob("ckpt-*.pt"))) >= 3 for c in ckpts))
    state = json.loads((project / "runs/stack-killed/sweep.json").read_text())
    assert all(r["status"] == "pending" for r in state["runs"].values())
    res = run_flock(cmd, project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["continued"] and s["finished"] == 2 and "0 of 2 runs finished, 2 resume from checkpoints" in res.stderr
    runs = json.loads((project / "runs/stack-killed/sweep.json").read_text())["runs"]
    for seed in (0, 1):
        summary = runs[f"base seed={seed}"]["summary"]
        assert summary["resumed_from_round"] >= 2 and summary["stack"]["cells"] == 2
        assert summary["stack"]["passes"] < summary["stack"]["calls"]  # the cells shared their passes
        ref = run_flock(["run", "mid.yaml", "--set", f"seed={seed}", "--run-dir", f"runs/stack-ref{seed}", "--json",
                         "--tracking-uri", uri(project)], project)
        assert ref.returncode == 0, ref.stderr
        assert last_json(ref.stdout)["state_sha256"] == s["children"][f"base seed={seed}"]["state_sha256"]


def test_ctrl_c_stops_a_parallel_sweep_and_the_same_command_continues_it(project):
    """--parallel 2 --no-stack: seed 0 runs in this process (it takes the first job while the worker
    imports), seed 1 in the worker process. A Ctrl-C (SIGINT to the process group, as a terminal
    sends it) once the worker's run has checkpoints stops the sweep (exit 130) with no run recorded
    as failed and the worker's run left to resume; the same command again finishes the sweep, and
    the worker's run ends in the state of the same run alone."""
    cmd = ["sweep", "long.yaml", "--seeds", "0", "1", "--sweep-dir", "runs/par-int", "--tracking-uri", uri(project),
           "--json", "--no-stack", "--parallel", "2"]
    worker = project / "runs/par-int/base-seed1/checkpoints"
    with _flock_process(cmd, project) as proc:
        _wait_for(lambda: len(list(worker.glob("ckpt-*.pt"))) >= 2, 240, proc)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    runs = json.loads((project / "runs/par-int/sweep.json").read_text())["runs"]
    assert runs["base seed=1"]["status"] == "pending" and runs["base seed=0"]["status"] in ("pending", "finished"), runs
    res = run_flock(cmd, project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["continued"] and s["finished"] == 2 and s["failed"] == 0
    summary = json.loads((project / "runs/par-int/sweep.json").read_text())["runs"]["base seed=1"]["summary"]
    assert summary["resumed_from_round"] >= 2
    ref = run_flock(["run", "long.yaml", "--set", "seed=1", "--run-dir", "runs/par-int-ref", "--json",
                     "--tracking-uri", uri(project)], project)
    assert ref.returncode == 0, ref.stderr
    assert last_json(ref.stdout)["state_sha256"] == s["children"]["base seed=1"]["state_sha256"]


def _worker_pids(cwd: Path) -> list[int]:
    """The sweep worker processes (flows/sweep_workers.py) working in ``cwd`` (a flockfl command may
    run in the resident flockfl's child, flows/resident.py, not in the process the test started)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"flows.sweep_workers" in (d / "cmdline").read_bytes() \
                    and Path(os.readlink(d / "cwd")) == cwd.resolve():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def test_a_worker_process_killed_mid_run_fails_its_run_and_the_sweep_goes_on(project):
    """--parallel 2 --no-stack: SIGKILL the worker process (only it) while its run (seed 1) is
    going: the sweep finishes seed 0 in its own process, records seed 1 as failed with the reason
    and exits 1; seed 1 keeps its checkpoints, from which the same command resumes it (as the
    Ctrl-C test above shows)."""
    cmd = ["sweep", "long.yaml", "--seeds", "0", "1", "--sweep-dir", "runs/worker-killed", "--tracking-uri", uri(project),
           "--json", "--no-stack", "--parallel", "2"]
    worker_ckpts = project / "runs/worker-killed/base-seed1/checkpoints"
    with _flock_process(cmd, project) as proc:
        _wait_for(lambda: len(list(worker_ckpts.glob("ckpt-*.pt"))) >= 2, 240, proc)
        pids = _worker_pids(project)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=180) == 1
    runs = json.loads((project / "runs/worker-killed/sweep.json").read_text())["runs"]
    assert runs["base seed=0"]["status"] == "finished"
    assert runs["base seed=1"]["status"] == "failed" and "worker process ended (exit code -9)" in runs["base seed=1"]["error"]
    assert list(worker_ckpts.glob("ckpt-*.pt"))


def test_sigkilled_flock_run_leaves_no_process(project):
    """The per-process Prefect API server starts with flockfl and dies with it, even on SIGKILL."""
    import psutil

    run_dir = project / "runs/orphan"
    with _flock_process(["run", "long.yaml", "--run-dir", str(run_dir), "--tracking-uri", uri(project)], project,
                        per_process=True) as proc:
        _wait_for(lambda: len(list((run_dir / "checkpoints").glob("ckpt-*.pt"))) >= 2, 180, proc)
        kids = psutil.Process(proc.pid).children(recursive=True)
        api = [k for k in kids if k.status() != psutil.STATUS_ZOMBIE
               and "prefect.server.api.server:create_app" in " ".join(k.cmdline())]
        assert api, f"no Prefect API server among flockfl's children: {[k.cmdline() for k in kids]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(kids, timeout=20)
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"


def test_flock_run_reports_its_fixed_cost_and_pickled_models_load(project):
    res = run_flock(["run", "sw.yaml", "--run-dir", "runs/cost", "--json", "--tracking-uri", uri(project),
                     "--set", "tracking.model_format=pickle"], project)
    assert res.returncode == 0, res.stderr
    assert "pickle" not in res.stderr.lower()  # MLflow's unpickling warning is for foreign files
    s = last_json(res.stdout)
    assert s["process_wall_s"] > s["wall_s"] > 0 and 0 < s["rounds_wall_s"] < s["wall_s"]
    assert s["outside_rounds_s"] == pytest.approx(s["process_wall_s"] - s["rounds_wall_s"])
    assert {"partition", "restore", "tracker", "drive", "finalise", "plots", "api_wait", "flow_start", "flow_end",
            "close_wait"} <= set(s["phases_s"])
    assert {"open", "close", "models"} <= set(s["tracking_s"])  # the tracking thread's share, off the rounds' path

    import mlflow.pytorch
    import torch

    from flockfl.state import load_latest

    mlflow.set_tracking_uri(uri(project))
    net = mlflow.pytorch.load_model(f"runs:/{s['run_id']}/cluster_1")
    assert isinstance(net, torch.nn.Module) and not isinstance(net, torch.fx.GraphModule)  # the model, not a trace
    state = load_latest(project / "runs/cost")[0]
    for name, p in net.state_dict().items():
        assert torch.equal(p, state.models[name][1])


def test_an_exported_prefect_api_url_is_used(project, tmp_path):
    """With PREFECT_API_URL set or in the active profile (flockfl server, Prefect Cloud) flockfl
    starts no server of its own."""
    from flows import apiserver

    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    code = ("import os; from flows import apiserver; s = apiserver.start(); "
            "print(s is None, os.environ['PREFECT_API_URL'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "http://127.0.0.1:9/api"]
    assert apiserver.ApiServerError  # the one-line error type the CLI catches

    # the same when the active Prefect profile names the API (prefect config set PREFECT_API_URL=…)
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://127.0.0.1:8/api"\n')
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, "PREFECT_HOME": str(home)}
    code = "from flows import apiserver; print(apiserver.start() is None, apiserver.configured_api_url())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "http://127.0.0.1:8/api"]
