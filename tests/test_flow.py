"""End to end through the real `flockfl` process: Prefect (ephemeral API), MLflow (SQLite
store, queried here), checkpoints, SIGKILL mid-round and `flockfl resume`."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from conftest import last_json, run_flock

pytestmark = pytest.mark.slow

CONFIG = {
    "name": "e2e", "seed": 1,
    "dataset": {"name": "digits"},
    "partition": {"scheme": "rotated", "num_clients": 16, "k": 2},
    "model": {"name": "mlp", "hidden": 32},
    "algorithm": {"name": "ifca", "k": 2, "init": "random"},  # no pre-federation checkpoint to count
    "train": {"rounds": 5, "clients_per_round": 8, "local_epochs": 1, "batch_size": 10, "lr": 0.1, "engine": "vectorized"},
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    (d / "e2e.yaml").write_text(yaml.safe_dump(CONFIG))
    return d


def uri(project) -> str:
    return f"sqlite:///{project}/mlflow.db"


@pytest.fixture(scope="module")
def reference_run(project):
    """One uninterrupted run: its summary is what every resumed run must reproduce."""
    res = run_flock(["run", "e2e.yaml", "--run-dir", "runs/full", "--json", "--tracking-uri", uri(project),
                     "--metrics-file", "metrics/e2e.json"], project)
    assert res.returncode == 0, res.stderr
    return last_json(res.stdout)


def test_json_summary(reference_run):
    s = reference_run
    for key in ("run_id", "rounds", "metrics", "state_sha256", "wall_s", "round_s_median"):
        assert key in s
    assert s["rounds"] == 5 and len(s["state_sha256"]) == 64
    for key in ("accuracy", "loss", "ari", "nmi", "num_clusters"):
        assert key in s["metrics"]
    assert s["engine"] == "vectorized" and s["round_s_median"] > 0


def test_mlflow_store_has_params_metrics_artifacts_and_models(project, reference_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    run = client.get_run(reference_run["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["algorithm.name"] == "ifca" and p["partition.scheme"] == "rotated" and p["train.rounds"] == "5"
    for key in ("accuracy", "accuracy_min", "accuracy_p10", "loss", "ari", "nmi", "num_clusters",
                "round_time_s", "bytes_total", "cluster/0/accuracy"):
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5], key
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/accuracy_curves.png", "plots/cluster_assignments.png"} <= arts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")] == ["checkpoint/ckpt-000005.pt",
                                                                                     "checkpoint/reference.json"]
    ref = json.loads(Path(client.download_artifacts(run.info.run_id, "checkpoint/reference.json")).read_text())
    assert ref["state_sha256"] == reference_run["state_sha256"] and Path(ref["checkpoint"]).is_file()
    versions = client.search_model_versions("name='flockfl-e2e'")
    assert sorted(v.tags.get("cluster") for v in versions) == ["0", "1"]
    assert all(v.run_id == run.info.run_id for v in versions)


def test_metrics_file_for_dvc(project, reference_run):
    import json

    m = json.loads((project / "metrics/e2e.json").read_text())
    assert m["rounds"] == 5 and m["accuracy"] == pytest.approx(reference_run["metrics"]["accuracy"])


@pytest.mark.parametrize("crash_at", ["0:select", "1:train", "2:checkpoint_tmp", "3:evaluate"])
def test_sigkill_then_resume_is_bit_identical(project, reference_run, crash_at):
    run_dir = f"runs/killed-{crash_at.replace(':', '-')}"
    res = run_flock(["run", "e2e.yaml", "--run-dir", run_dir, "--json", "--tracking-uri", uri(project)], project,
                    env={"FLOCKFL_CRASH_AT": crash_at})
    assert res.returncode == -signal.SIGKILL, res.stderr
    done = int(crash_at.split(":")[0])  # rounds completed before the crash (checkpoint_tmp: not renamed yet)
    ckpts = sorted((project / run_dir / "checkpoints").glob("ckpt-*.pt")) if done else []
    assert len(ckpts) == done
    resumed = run_flock(["resume", run_dir, "--json"], project)
    assert resumed.returncode == 0, resumed.stderr
    s = last_json(resumed.stdout)
    assert s["resumed_from_round"] == done
    assert s["state_sha256"] == reference_run["state_sha256"]
    assert s["metrics"] == reference_run["metrics"]
    # the same MLflow run, each round logged exactly once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    steps = [m.step for m in client.get_metric_history(s["run_id"], "round")]
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert client.get_run(s["run_id"]).info.status == "FINISHED"


def test_resume_by_mlflow_run_id(project, reference_run):
    res = run_flock(["run", "e2e.yaml", "--run-dir", "runs/by-id", "--json", "--tracking-uri", uri(project)], project,
                    env={"FLOCKFL_CRASH_AT": "2:aggregate"})
    assert res.returncode == -signal.SIGKILL
    import json

    run_id = json.loads((project / "runs/by-id/run.json").read_text())["mlflow_run_id"]
    resumed = run_flock(["resume", run_id, "--json", "--tracking-uri", uri(project)], project)
    assert resumed.returncode == 0, resumed.stderr
    s = last_json(resumed.stdout)
    assert s["run_id"] == run_id and s["state_sha256"] == reference_run["state_sha256"]


def test_failing_client_is_retried_dropped_and_recorded(project):
    res = run_flock(["run", "e2e.yaml", "--run-dir", "runs/faulty", "--json", "--tracking-uri", uri(project),
                     "--set", "train.simulate_failures=[3]", "--set", "train.clients_per_round=16",
                     "--set", "train.rounds=2", "--set", "tracking.register_model=false"], project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["clients_dropped"] == 2 and s["rounds"] == 2  # client 3 dropped in both rounds, the rounds went on
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(uri(project)).get_metric_history(s["run_id"], "clients_dropped")
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == [1.0, 1.0]


def test_resume_with_a_corrupt_newest_checkpoint_falls_back(project, reference_run):
    res = run_flock(["run", "e2e.yaml", "--run-dir", "runs/corrupt", "--json", "--tracking-uri", uri(project)], project,
                    env={"FLOCKFL_CRASH_AT": "3:select"})
    assert res.returncode == -signal.SIGKILL
    newest = sorted((project / "runs/corrupt/checkpoints").glob("ckpt-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:-50])  # truncated
    resumed = run_flock(["resume", "runs/corrupt", "--json"], project)
    assert resumed.returncode == 0, resumed.stderr
    s = last_json(resumed.stdout)
    assert s["resumed_from_round"] == 2 and s["state_sha256"] == reference_run["state_sha256"]
    assert "checksum mismatch" in resumed.stderr and newest.name in resumed.stderr


def test_existing_run_dir_is_not_overwritten(project, reference_run):
    res = run_flock(["run", "e2e.yaml", "--run-dir", "runs/full", "--tracking-uri", uri(project)], project, timeout=120)
    # the path typed is made absolute (it means what it meant where it was typed)
    assert res.returncode == 2 and f"flockfl resume {(project / 'runs/full').resolve()}" in res.stderr


def test_flock_ui_serves_mlflow_on_loopback(project, reference_run):
    """`flockfl ui` starts the real MLflow UI on 127.0.0.1 against the same store."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import flock_env

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port), "--tracking-uri", uri(project)],
                            cwd=project, env=flock_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        body = None
        for _ in range(90):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        assert body == b"OK"
        q = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={reference_run['run_id']}",
                                   timeout=10).read()
        assert reference_run["run_id"].encode() in q
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_compare_benchmark_nests_one_run_per_algorithm(project):
    """benchmarks/compare.py: every algorithm a nested MLflow run under one parent, one table."""
    import subprocess
    import sys

    from conftest import ROOT, flock_env

    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/compare.py"), "--base", "e2e.yaml",
                          "--algorithms", "fedavg", "scaffold", "--set", "train.rounds=2",
                          "--target", "0.05", "--tracking-uri", uri(project), "--params", str(project / "none.yaml")],
                         cwd=project, env=flock_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    table = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| algorithm | final acc | best acc | p10 acc | rounds to target")
    assert [row.split("|")[1].strip() for row in table[1:]] == ["fedavg", "scaffold"]  # "|---|" is not "| "
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    parent_id = res.stdout.split("MLflow parent run ")[1].split()[0]
    exp = client.get_run(parent_id).info.experiment_id
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(c.data.params["algorithm.name"] for c in children) == ["fedavg", "scaffold"]


PACFL = {
    "name": "e2e-pacfl", "seed": 2,
    "dataset": {"name": "digits"},
    "partition": {"scheme": "label_swap", "k": 2, "label_swap_mode": "random_perm", "num_clients": 12,
                  "unseen_fraction": 0.25},
    "model": {"name": "mlp", "hidden": 32},
    "algorithm": {"name": "pacfl", "measure": "class_matched", "cut": "largest_gap"},  # no β: the library's rule
    "train": {"rounds": 3, "clients_per_round": 4, "local_epochs": 2, "batch_size": 10, "lr": 0.1, "engine": "vectorized"},
}


@pytest.fixture(scope="module")
def pacfl_run(project):
    (project / "pacfl.yaml").write_text(yaml.safe_dump(PACFL))
    res = run_flock(["run", "pacfl.yaml", "--run-dir", "runs/pacfl", "--json", "--tracking-uri", uri(project)], project)
    assert res.returncode == 0, res.stderr
    return last_json(res.stdout)


def test_pacfl_run_logs_its_pre_federation_newcomers_and_both_conventions(project, pacfl_run):
    """The pre-federation stage is its own task with its cost logged; newcomers join; the
    after-local-training accuracy is beside the cluster models' accuracy."""
    s = pacfl_run
    assert s["pre_federation"]["bytes_up"] > 0 and s["pre_federation"]["seconds"] > 0
    assert s["bytes_total"] > s["pre_federation"]["bytes_up"]  # the rounds' transfers plus the one-shot upload
    m = s["metrics"]
    for key in ("accuracy", "accuracy_finetuned", "unseen_accuracy", "unseen_accuracy_untuned", "ari", "num_clusters"):
        assert key in m, key
    assert len(s["newcomers"]["clients"]) == 3 and s["newcomers"]["rule"].startswith("PME")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    run = client.get_run(s["run_id"])
    # one-off numbers are params (MLflow's charts would show single points); series are metrics
    assert float(run.data.params["pre_federation_bytes_up"]) == s["pre_federation"]["bytes_up"]
    assert run.data.metrics["unseen_accuracy"] == m["unseen_accuracy"]
    assert 0 <= float(run.data.params["partition_emd"]) <= 1 and float(run.data.params["partition_angle_eq31"]) >= 0
    names = {a.path for a in client.list_artifacts(s["run_id"], "plots")}
    assert "plots/pacfl_proximity.png" in names
    assert any(a.path == "newcomers.json" for a in client.list_artifacts(s["run_id"]))


@pytest.mark.parametrize("point", ["0:pre_federation", "1:select"])
def test_pacfl_resume_after_a_kill_is_bit_identical(project, pacfl_run, point):
    run_dir = f"runs/pacfl-kill-{point.split(':')[1]}"
    res = run_flock(["run", "pacfl.yaml", "--run-dir", run_dir, "--json", "--tracking-uri", uri(project)], project,
                    env={"FLOCKFL_CRASH_AT": point})
    assert res.returncode == -signal.SIGKILL
    from flockfl.state import load_latest

    kept, _ = load_latest(project / run_dir)
    res = run_flock(["resume", run_dir, "--json"], project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["state_sha256"] == pacfl_run["state_sha256"]
    assert s["metrics"] == pacfl_run["metrics"] and s["newcomers"] == pacfl_run["newcomers"]
    if point == "1:select":  # killed in round 1: the pre-federation result, its measured seconds
        assert s["resumed_from_round"] == 1  # included, came from the checkpoint: it was not redone
        assert s["pre_federation"] == kept.driver.pre_federation
    else:  # killed inside the pre-federation step, before its checkpoint: it ran again
        assert kept is None


FEDCLUSTER_SHIFT = {
    "name": "e2e-fedcluster", "seed": 3,
    "dataset": {"name": "digits"},
    "partition": {"scheme": "rotated", "num_clients": 12, "k": 2},
    "model": {"name": "mlp", "hidden": 32},
    "algorithm": {"name": "fedcluster", "k": 3},
    "shift": {"kind": "swap_all", "probability": 0.3},
    "train": {"rounds": 3, "clients_per_round": 6, "local_epochs": 1, "batch_size": 10, "lr": 0.1, "engine": "vectorized"},
}


@pytest.fixture(scope="module")
def fedcluster_run(project):
    (project / "fedcluster.yaml").write_text(yaml.safe_dump(FEDCLUSTER_SHIFT))
    res = run_flock(["run", "fedcluster.yaml", "--run-dir", "runs/fedcluster", "--json", "--tracking-uri", uri(project)],
                    project)
    assert res.returncode == 0, res.stderr
    return last_json(res.stdout)


def test_a_kill_between_cycles_of_a_shifting_run_resumes_bit_identically(project, fedcluster_run):
    """FedCluster checkpoints after every cycle; the shift is in the state: killed after round
    1's first cycle, the resumed run continues at its second cycle and ends where the
    uninterrupted one did, with the same shift counts in MLflow."""
    run_dir = "runs/fedcluster-killed"
    res = run_flock(["run", "fedcluster.yaml", "--run-dir", run_dir, "--json", "--tracking-uri", uri(project)], project,
                    env={"FLOCKFL_CRASH_AT": "1:cycle"})
    assert res.returncode == -signal.SIGKILL
    from flockfl.state import load_latest

    kept, _ = load_latest(project / run_dir)
    assert kept.round == 1 and kept.driver.partial_round["cycle"] == 1
    res = run_flock(["resume", run_dir, "--json"], project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    assert s["state_sha256"] == fedcluster_run["state_sha256"] and s["metrics"] == fedcluster_run["metrics"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri(project))
    shifted = lambda rid: [m.value for m in sorted(client.get_metric_history(rid, "clients_shifted"), key=lambda m: m.step)]  # noqa: E731
    assert shifted(s["run_id"]) == shifted(fedcluster_run["run_id"]) and len(shifted(s["run_id"])) == 3
