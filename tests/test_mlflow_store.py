"""The MLflow store as flockfl uses it (issue 18): several `flockfl run`s started at once on a new
SQLite store all finish (only one of them creates the schema), and every experiment flockfl
creates or reuses is a training experiment (``mlflow.experimentKind``), so the MLflow 3 UI
opens it on its runs and charts, not on the GenAI (traces) view."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import yaml

from conftest import flock_env, last_json, tiny_config

pytestmark = pytest.mark.slow

EXPERIMENT = "store-test"
KIND = "custom_model_development"


def test_runs_started_together_on_a_new_store_all_finish(tmp_path):
    """Two real `flockfl run` processes started at once (as a shell loop with ``&`` does) on an
    MLflow store and a Prefect home that do not exist yet: all exit 0, and the store holds both finished runs in one
    experiment that carries the training kind tag."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(
        train={"rounds": 2},
        tracking={"enabled": True, "experiment": EXPERIMENT, "register_model": False, "plots": False})))
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    assert not db.exists()
    # a new Prefect home too: the per-process Prefect API servers must not migrate one new
    # database at once either (flows/apiserver's first-start lock)
    env = flock_env({"PREFECT_HOME": str(tmp_path / "prefect-home")}, per_process=True)
    procs = []
    for i in range(2):  # two race as three do (a third cost 25 s of the suite)
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "flows.cli", "run", "tiny.yaml", "--run-dir", f"runs/r{i}", "--json",
               "--no-progress", "--tracking-uri", uri, "--partitions", str(tmp_path / "parts")]
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, text=True,
                                       start_new_session=True), out, err))
    results = []
    for proc, out, err in procs:
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, 9)  # the run and anything it left behind
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        results.append((rc, out.read(), err.read()))
        out.close()
        err.close()
    for rc, _, stderr in results:
        assert rc == 0, stderr[-3000:]
    run_ids = {last_json(stdout)["run_id"] for _, stdout, _ in results}
    assert len(run_ids) == 2

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id])
    assert {r.info.run_id for r in runs} == run_ids
    assert all(r.info.status == "FINISHED" for r in runs)
    assert exp.tags.get("mlflow.experimentKind") == KIND


def test_every_experiment_flockfl_opens_is_a_training_experiment(tmp_path):
    """A new experiment, one created without the tag (an older flockfl, or by hand) and reused,
    and one reused through a resumed run (``run_id`` given): each ends up tagged."""
    from mlflow.tracking import MlflowClient

    from flows.tracking.store import ensure_experiment
    from flows.tracking.tracker import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    fresh = Tracker(uri, "fresh", "a")
    fresh.finish()
    client = MlflowClient(uri)
    assert client.get_experiment(fresh.experiment_id).tags.get("mlflow.experimentKind") == KIND

    old = client.create_experiment("old", artifact_location=str(tmp_path / "art"))
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    reused = Tracker(uri, "old", "b")
    assert reused.experiment_id == old
    assert client.get_experiment(old).tags.get("mlflow.experimentKind") == KIND

    older = client.create_experiment("older", artifact_location=str(tmp_path / "art2"))
    run_id = client.create_run(older).info.run_id
    Tracker(uri, "ignored-on-resume", "c", run_id=run_id).finish()
    assert client.get_experiment(older).tags.get("mlflow.experimentKind") == KIND

    # the helper itself: idempotent, same id, and a GenAI kind (set by hand or by a UI) is
    # turned back into the training kind: flockfl's experiments hold training runs
    assert ensure_experiment("old", uri) == old == ensure_experiment("old", uri)
    client.set_experiment_tag(old, "mlflow.experimentKind", "genai_development")
    assert ensure_experiment("old", uri) == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == KIND
    new = ensure_experiment("new", uri)
    assert client.get_experiment(new).tags["mlflow.experimentKind"] == KIND
