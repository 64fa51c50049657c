"""The resident flockfl (flows/resident.py): a command it forks is the command a plain process
runs (same state digest, exit status, one-line errors), signals reach it, a killed client takes
its command with it, the export finishes after a detached command returned, and the key keeps
one resident per code tree and import-time environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, flock_env, last_json, run_flock, tiny_config
from flows import resident

CONFIG = tiny_config(name="res", seed=1, train={"rounds": 2})
TRACKED = tiny_config(name="rest", seed=1, algorithm={"name": "ifca", "k": 2, "init": "random"}, train={"rounds": 2},
                      tracking={"enabled": True, "register_model": True, "plots": False, "model_format": "pickle"})


# ------------------------------------------------------------------ without a process


def test_the_key_is_the_code_and_the_import_time_environment_not_the_run_environment(tmp_path, monkeypatch):
    base = dict(os.environ)
    k = resident.key(base)
    assert resident.key({**base, "PREFECT_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": "sqlite:///x.db",
                         "FLOCKFL_WAIT": "1", "PYTEST_CURRENT_TEST": "t"}) == k
    assert resident.key({**base, "OMP_NUM_THREADS": "7"}) != k  # read when torch loads
    assert resident.key({**base, "ATEN_CPU_CAPABILITY": "default"}) != k
    monkeypatch.chdir(tmp_path)  # the working folder is no part of it
    assert resident.key(base) == k


def test_a_touched_source_file_gives_another_key(tmp_path):
    src = ROOT / "flows" / "resident.py"
    before = resident.key()
    st = src.stat()
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert resident.key() != before
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resident.key() == before


def test_what_a_resident_learns_to_preload_leaves_a_projects_own_modules_out(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOCKFL_RESIDENT_DIR", str(tmp_path))
    (tmp_path / "my_plugin_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_plugin_mod  # noqa: F401

    import flockfl.rounds  # noqa: F401

    resident.learn({"json", "my_plugin_mod", "flockfl.rounds"})
    learned = resident._learned()
    assert {"json", "flockfl.rounds"} <= learned and "my_plugin_mod" not in learned


def test_commands_that_manage_processes_of_their_own_are_not_routed(monkeypatch):
    monkeypatch.setenv("FLOCKFL_RESIDENT_DIR", "/nonexistent-flockfl-resident")
    for argv in (["server"], ["ui"], ["schedule", "serve"], ["--verbose", "server"]):
        assert resident.forward(argv) is None
    monkeypatch.setenv("FLOCKFL_RESIDENT", "off")
    assert resident.forward(["run", "x"]) is None


# ------------------------------------------------------------------ real processes


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("resident")
    (d / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (d / "res.yaml").write_text(yaml.safe_dump(CONFIG))
    (d / "rest.yaml").write_text(yaml.safe_dump(TRACKED))
    (d / "bad.yaml").write_text(yaml.safe_dump(tiny_config(name="bad", train={"rounds": -1})))
    return d


@pytest.fixture(scope="module")
def own_resident(tmp_path_factory):
    """A resident of this module's own (not the session's), started by a first command and
    waited for; asked to leave afterwards."""
    where = tmp_path_factory.mktemp("resident-dir")
    env = {"FLOCKFL_RESIDENT_DIR": str(where), "FLOCKFL_RESIDENT": "auto"}
    yield where, env
    resident.stop(where)


def _wait_for_socket(where: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not list(where.glob("*.sock")):
        assert time.monotonic() < deadline, f"no resident in {where}: {[p.name for p in where.iterdir()]}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_command_the_resident_runs_is_the_command_a_plain_process_runs(project, own_resident):
    where, env = own_resident
    # the first command finds no resident: it runs as a plain process, then starts one
    plain = run_flock(["run", "res.yaml", "--run-dir", "runs/plain", "--json"], project, env)
    assert plain.returncode == 0, plain.stderr
    _wait_for_socket(where)
    served = run_flock(["run", "res.yaml", "--run-dir", "runs/served", "--json"], project, env)
    assert served.returncode == 0, served.stderr
    p, s = (last_json(r.stdout) for r in (plain, served))
    assert (p["resident"], s["resident"]) == (False, True)
    assert p["state_sha256"] == s["state_sha256"]
    assert p["metrics"] == s["metrics"]
    # its fixed cost is counted from the client's start, as a plain process counts from its own
    assert 0 < s["outside_rounds_s"] < s["process_wall_s"]
    # the same one-line error and exit status
    bad_plain = run_flock(["run", "bad.yaml"], project, {**env, "FLOCKFL_RESIDENT": "off"})
    bad = run_flock(["run", "bad.yaml"], project, env)
    assert bad.returncode == bad_plain.returncode == 2
    assert bad.stderr == bad_plain.stderr and len(bad.stderr.strip().splitlines()) == 1
    # a listing's output, through a pipe, ends (EOF) with the command
    listing = run_flock(["list", "--json"], project, env)
    assert listing.returncode == 0 and json.loads(listing.stdout.strip().splitlines()[-1])


def _ensure(where: Path, project: Path, env: dict) -> None:
    if not list(where.glob("*.sock")):
        run_flock(["list"], project, env)  # a first command starts it
    _wait_for_socket(where)


def _children_of(pid: int) -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process(pid).children()}
    except psutil.NoSuchProcess:
        return set()


def _resident_pid(where: Path) -> int:
    return int(next(where.glob("*.pid")).read_text())


def _start(project: Path, env: dict, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=project, env=flock_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_rounds(run_dir: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list((run_dir / "checkpoints").glob("ckpt-*.pt")):
        assert time.monotonic() < deadline, "the run never checkpointed"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_signal_reaches_the_command_and_a_killed_client_takes_its_command_with_it(project, own_resident):
    where, env = own_resident
    _ensure(where, project, env)
    zygote = _resident_pid(where)
    long_run = ["run", "res.yaml", "--set", "train.rounds=100000", "--no-progress"]
    # Ctrl-C (SIGINT to the client): the command is interrupted as a plain one is, exit 130
    proc = _start(project, env, [*long_run, "--run-dir", "runs/sigint"])
    _wait_for_rounds(project / "runs" / "sigint")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; continue with flockfl resume" in err
    # SIGKILL of the client: the resident kills the command it ran for it
    proc = _start(project, env, [*long_run, "--run-dir", "runs/sigkill"])
    _wait_for_rounds(project / "runs" / "sigkill")
    commands = _children_of(zygote) - {s.pid for s in _api_servers(zygote)}
    assert commands, "the command is not the resident's child"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while commands & _children_of(zygote) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not commands & _children_of(zygote)


def _api_servers(pid: int) -> list:
    import psutil

    found = []
    for c in psutil.Process(pid).children():
        try:
            if "uvicorn" in " ".join(c.cmdline()):
                found.append(c)
        except psutil.Error:  # a command's child that ended and is not reaped yet (a zombie), or gone
            continue
    return found


@pytest.mark.slow
def test_a_detached_command_returns_before_its_export_which_then_finishes(project, own_resident):
    from mlflow.tracking import MlflowClient

    where, env = own_resident
    uri = f"sqlite:///{project}/mlflow.db"
    _ensure(where, project, env)
    res = run_flock(["run", "rest.yaml", "--run-dir", "runs/detached", "--json", "--tracking-uri", uri], project,
                    {**env, "FLOCKFL_WAIT": "0"})
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["resident"] and s["export"] == "background" and "model_versions" not in s
    client = MlflowClient(uri)
    deadline = time.monotonic() + 120
    while client.get_run(s["run_id"]).info.status != "FINISHED":
        assert time.monotonic() < deadline, "the detached export never finished the run"
        time.sleep(0.5)
    assert len(client.search_model_versions(f"run_id = '{s['run_id']}'")) == 2
    waited = run_flock(["run", "rest.yaml", "--run-dir", "runs/waited", "--json", "--tracking-uri", uri, "--wait"],
                       project, {**env, "FLOCKFL_WAIT": "0"})
    w = last_json(waited.stdout)
    assert "export" not in w and len(w["model_versions"]) == 2
    assert client.get_run(w["run_id"]).info.status == "FINISHED"
    assert w["state_sha256"] == s["state_sha256"]


@pytest.mark.slow
def test_a_resident_asked_to_stop_leaves(own_resident, project):
    where, env = own_resident
    _ensure(where, project, env)
    pid = _resident_pid(where)
    assert resident.stop(where) == [pid]
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(where.glob("*.sock")) and not list(where.glob("*.pid"))


@pytest.mark.slow
def test_the_resident_keeps_one_prefect_api_per_home_and_stops_it_when_unused(tmp_path, project):
    """Without a configured API a command uses the resident's server for its Prefect home: the
    next command finds the same one; once no command used it for FLOCKFL_RESIDENT_API_IDLE_S, it goes."""
    where = tmp_path / "res"
    env = flock_env({"FLOCKFL_RESIDENT_DIR": str(where), "FLOCKFL_RESIDENT": "auto", "FLOCKFL_RESIDENT_API_IDLE_S": "8",
                     "PREFECT_HOME": str(tmp_path / "prefect-home")})
    env.pop("PREFECT_API_URL")

    def run(tag: str) -> dict:
        res = subprocess.run([sys.executable, "-m", "flows.cli", "run", "res.yaml", "--run-dir", f"runs/api-{tag}", "--json"],
                             cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return last_json(res.stdout)

    try:
        # a first command, plain, starts the resident (`list`: a run would only add its rounds)
        assert subprocess.run([sys.executable, "-m", "flows.cli", "list"], cwd=project, env=env, capture_output=True,
                              timeout=300).returncode == 0
        _wait_for_socket(where)
        zygote = _resident_pid(where)
        assert run("second")["resident"]
        servers = {s.pid for s in _api_servers(zygote)}
        assert len(servers) == 1
        assert run("third")["resident"] and {s.pid for s in _api_servers(zygote)} == servers
        deadline = time.monotonic() + 90
        while _api_servers(zygote) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _api_servers(zygote), "the unused API server was never stopped"
    finally:
        resident.stop(where)
