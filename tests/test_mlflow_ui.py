"""The MLflow UI as a researcher meets it (issue 32): a run's MLflow names sort the headline
series first and put the long tail under prefixes, numbers a run has once are params, every run
carries its git commit and whether the tree was dirty; ``flockfl ui`` opens an experiment's runs
with accuracy, ARI, clusters and duration as columns (checked in headless Chromium); and the
servers flockfl starts leave nothing behind, even when flockfl is killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import assert_not_blank, browse, flock_env, free_port, last_json, needs_chromium, run_flock, tiny_config

# ---------------------------------------------------------------------- names (no MLflow needed)


def test_metric_names_put_the_protocols_under_eval_and_read_back():
    from flows.tracking.names import metric_name, row_key

    cases = {"accuracy": "accuracy", "ari": "ari", "num_clusters": "num_clusters", "loss": "loss",
             "cluster/3/accuracy": "cluster/3/accuracy", "accuracy_p10": "accuracy_p10",
             "accuracy__label_union__clients": "eval/accuracy__label_union__clients",
             "loss_finetuned__proportional__samples": "eval/loss_finetuned__proportional__samples",
             "accuracy_min__label_union": "eval/accuracy_min__label_union"}
    for key, name in cases.items():
        assert metric_name(key) == name
        assert row_key(name) == key
    # the accuracy family sorts together (the protocols' series no longer sit between accuracy and ari)
    assert sorted(cases.values())[:3] == ["accuracy", "accuracy_p10", "ari"]


def test_summary_metrics_reads_old_and_new_runs_alike():
    from flows.tracking.names import summary_metrics

    old = {"accuracy": 0.5, "accuracy__proportional__samples": 0.5, "accuracy__proportional__samples__final": 0.5,
           "partition_emd": 0.3, "pre_federation_seconds": 1.5}
    new_metrics = {"accuracy": 0.5, "eval/accuracy__proportional__samples": 0.5}
    new_params = {"accuracy__proportional__samples__final": "0.5", "partition_emd": "0.3",
                  "pre_federation_seconds": "1.5", "train.lr": "0.1", "algorithm.name": "ifca"}
    assert summary_metrics(old, {"train.lr": "0.1"}) == old
    assert summary_metrics(new_metrics, new_params) == old


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def test_source_tags_name_the_commit_and_a_dirty_tree(tmp_path):
    from flows.tracking import source as tracking

    repo = tmp_path / "proj"
    (repo / "sub").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD").strip()
    tracking._SOURCE.clear()
    t0 = time.perf_counter()
    tags = tracking.source_tags(repo / "sub")
    took = time.perf_counter() - t0
    assert tags == {"mlflow.source.git.commit": head, "mlflow.source.git.branch": "main", "flockfl.git_dirty": "false"}
    assert took < 2.0, took  # one `git status`
    (repo / "untracked.txt").write_text("not code\n")  # untracked files do not make it dirty
    tracking._SOURCE.clear()
    assert tracking.source_tags(repo)["flockfl.git_dirty"] == "false"
    (repo / "a.py").write_text("x = 2\n")
    assert tracking.source_tags(repo)["flockfl.git_dirty"] == "false"  # cached: once per process
    tracking._SOURCE.clear()
    assert tracking.source_tags(repo)["flockfl.git_dirty"] == "true"
    # outside git, and a repository without a commit: no tags, no error
    (tmp_path / "plain").mkdir()
    assert tracking.source_tags(tmp_path / "plain") == {}
    _git(tmp_path / "plain", "init", "-q")
    tracking._SOURCE.clear()
    assert tracking.source_tags(tmp_path / "plain") == {}
    tracking._SOURCE.clear()


def test_results_view_is_the_runs_table_state_mlflow_reads():
    import json

    from flows.tracking.view import RESULTS_VIEW, results_view_state, ui_url

    state = results_view_state({"accuracy", "ari", "num_clusters", "accuracy_finetuned"})
    assert state["selectedColumns"] == ["metrics.`accuracy`", "metrics.`ari`", "metrics.`num_clusters`",
                                        "metrics.`accuracy_finetuned`", "attributes.`Duration`"]
    assert state["columnOrder"][3:] == state["selectedColumns"][:4]  # the headline first, in this order
    assert "metrics.`accuracy_finetuned`" not in results_view_state({"accuracy"})["selectedColumns"]
    json.dumps(state)
    assert ui_url("http://h:1", "7", view=RESULTS_VIEW) == \
        "http://h:1/#/experiments/7/runs?viewStateShareKey=flockfl-results&workflowType=machine_learning"
    assert ui_url("http://h:1", "7") == "http://h:1/#/experiments/7?workflowType=machine_learning"


# ---------------------------------------------------------------------- a real run, a real UI

EXPERIMENT = "ui-test"
RUN = "ui-run"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real tiny `flockfl run` (IFCA, 2 rounds) tracked in a new SQLite store."""
    root = tmp_path_factory.mktemp("ui")
    (root / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(
        algorithm={"name": "ifca", "k": 2}, train={"rounds": 2},
        tracking={"enabled": True, "experiment": EXPERIMENT, "register_model": False, "plots": False})))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    res = run_flock(["run", "tiny.yaml", "--run-dir", f"runs/{RUN}", "--json", "--no-progress", "--tracking-uri", uri,
                     "--partitions", str(root / "parts")], root, env={"PREFECT_HOME": str(root / "prefect")})
    assert res.returncode == 0, res.stderr[-3000:]
    return {"root": root, "uri": uri, "summary": last_json(res.stdout)}


@pytest.mark.slow
def test_a_real_run_logs_headline_series_prefixes_params_and_its_commit(store):
    from mlflow.tracking import MlflowClient

    from flows.report import load_run
    from flows.tracking.names import summary_metrics

    s = store["summary"]
    client = MlflowClient(store["uri"])
    run = client.get_run(s["run_id"])
    names = set(run.data.metrics)
    assert {"accuracy", "ari", "num_clusters", "loss", "round", "cluster/0/accuracy",
            "eval/accuracy__label_union__clients", "eval/accuracy_p10__proportional"} <= names
    assert not [n for n in names if "__" in n and not n.startswith("eval/")]  # every protocol's series is under eval/
    # once-only numbers: params, not one-point metrics
    params = run.data.params
    assert "partition_emd" in params and f"accuracy__proportional__samples__{'final'}" in params
    assert not [n for n in names if n.startswith(("partition_", "pre_federation_")) or n.count("__") == 3]
    # every metric is a series over the rounds (fine-tuned accuracy is measured at the last round only)
    one_point = [n for n in names if len(client.get_metric_history(s["run_id"], n)) == 1]
    assert all("finetuned" in n for n in one_point), one_point
    # the summary's names, read back from MLflow, are the run's own
    back = summary_metrics(run.data.metrics, params)
    for k, v in s["metrics"].items():
        if k.count("__") == 3 or k in ("accuracy", "ari", "num_clusters"):
            assert back[k] == pytest.approx(v), k
    final = load_run(client, run, store["root"] / "dl").final
    assert final["accuracy__proportional__samples__final"] == pytest.approx(s["metrics"]["accuracy__proportional__samples__final"])
    # where the code came from
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode == 0:
        assert run.data.tags["mlflow.source.git.commit"] == head.stdout.strip()
        assert run.data.tags["flockfl.git_dirty"] in ("true", "false")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _group_members(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if ln.split() and int(ln.split()[0]) == pgid
            and ln.split()[2][0] != "Z"]


def _guard_of(pid: int) -> int:
    """The guard process flockfl started (its child that leads a process group)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pgid="], capture_output=True, text=True).stdout
    kids = [int(p) for p, pp, g in (ln.split() for ln in out.splitlines()) if int(pp) == pid and p == g]
    assert len(kids) == 1, out
    return kids[0]


def _start(args: list[str], cwd: Path, log: Path, ready: str, env: dict | None = None) -> subprocess.Popen:
    """A real flockfl server command, started as a person starts it; returns when ``ready`` is printed."""
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=flock_env(env),
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_session(proc)
            pytest.fail(f"{args[0]} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return proc


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _assert_nothing_left(proc: subprocess.Popen, sig: int, port: int, within: float = 10.0) -> tuple[float, float]:
    """Send ``sig`` to flockfl alone; within ``within`` s nothing listens on ``port`` and the
    server's process group is empty. Returns (seconds to a free port, seconds to an empty group)."""
    guard = _guard_of(proc.pid)
    assert _listening(port) and _group_members(guard)
    os.kill(proc.pid, sig)
    t0 = time.monotonic()
    free = None
    while time.monotonic() - t0 < within:
        if free is None and not _listening(port):
            free = time.monotonic() - t0
        if free is not None and not _group_members(guard):
            break
        time.sleep(0.1)
    empty = time.monotonic() - t0
    left = _group_members(guard)
    for pid in (int(ln.split()[1]) for ln in left):  # the test leaves nothing either
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert free is not None, f"port {port} still listened on {within} s after {signal.Signals(sig).name} of flockfl"
    assert not left, f"left after {within} s: {left}"
    proc.wait(timeout=30)
    print(f"{signal.Signals(sig).name}: port free after {free:.2f}s, process group empty after {empty:.2f}s")
    return free, empty


@pytest.mark.slow
@needs_chromium
def test_flockfl_ui_opens_the_runs_with_the_headline_columns_and_dies_with_sigkill(store, tmp_path):
    port = free_port()
    ui = _start(["ui", "--port", str(port), "--tracking-uri", store["uri"], "--no-open"], store["root"],
                tmp_path / "ui.log", "Ctrl-C stops it")
    try:
        out = (tmp_path / "ui.log").read_text()
        link = re.search(rf"runs of {EXPERIMENT}: (\S+)", out)
        assert link, out[-2000:]
        link = link.group(1)
        assert link.startswith(f"http://127.0.0.1:{port}/#/experiments/") and "viewStateShareKey=flockfl-results" in link
        shot = tmp_path / "runs.png"
        dom = browse(link, shot)
        assert_not_blank(shot, min_colours=100)
        # the runs table's header cells: MLflow names each by its column id; the headline columns are there
        ids = set(re.findall(r'role="columnheader"[^>]*col-id="([^"]+)"', dom))
        assert {"metrics.`accuracy`", "metrics.`ari`", "metrics.`num_clusters`", "duration"} <= ids, sorted(ids)
        assert re.search(r'col-id="metrics.`accuracy`".{0,3000}?>accuracy<', dom, re.S), "no 'accuracy' header text"
        assert "flockfl: results" in dom  # the saved view, by name
        (tmp_path / "runs.html").write_text(dom)
        assert ">1</" in dom and "matching run" in dom, "not one matching run"
        assert RUN in dom, "the run's name is not on the page"  # named after its run folder
    except BaseException:
        _kill_session(ui)
        raise
    _assert_nothing_left(ui, signal.SIGKILL, port)


@pytest.mark.slow
@pytest.mark.parametrize("command, sig", [("ui", signal.SIGTERM), ("server", signal.SIGKILL)])
def test_a_killed_server_command_leaves_nothing_behind(command, sig, tmp_path):
    port = free_port()
    args = [command, "--port", str(port)]
    if command == "ui":
        args += ["--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}", "--no-open"]
        ready = "Ctrl-C stops it"
    else:
        ready = "export PREFECT_API_URL"
    proc = _start(args, tmp_path, tmp_path / f"{command}.log", ready, env={"PREFECT_HOME": str(tmp_path / "prefect")})
    try:
        _assert_nothing_left(proc, sig, port)
    finally:
        _kill_session(proc)
