"""A run's fixed cost (issue 22): its tracking runs on a background thread (MLflow imported and
its store opened while the data loads, the models exported while the process ends), and what
that must never cost: the models are there once the process has exited, a kill during the
export leaves a run that ``flockfl resume`` finishes without duplicates, a failed tracking call
stops the run from being marked FINISHED. Also the two model formats side by side: both load
back through ``runs:/`` and the registry's ``models:/`` with the same outputs."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
import yaml

from conftest import last_json, run_flock, tiny_config

CONFIG = tiny_config(name="fc", seed=0, algorithm={"name": "ifca", "k": 2, "init": "random"},
                     train={"rounds": 3},
                     tracking={"enabled": True, "register_model": True, "plots": False, "model_format": "pickle"})


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("fixed-cost")
    (d / "fc.yaml").write_text(yaml.safe_dump(CONFIG))
    return d


def uri(project) -> str:
    return f"sqlite:///{project}/mlflow.db"


def _versions(client, run_id: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in client.search_model_versions(f"run_id = '{run_id}'"):
        out.setdefault(v.tags.get("cluster"), []).append(str(v.version))
    return out


def _logged(client, run) -> list[str]:
    return sorted(m.name for m in client.search_logged_models([run.info.experiment_id],
                                                              filter_string=f"source_run_id = '{run.info.run_id}'"))


@pytest.mark.slow
def test_models_exported_in_the_background_are_there_after_the_process_exits(project):
    res = run_flock(["run", "fc.yaml", "--run-dir", "runs/full", "--json", "--tracking-uri", uri(project)], project)
    assert res.returncode == 0, res.stderr
    s = last_json(res.stdout)
    # the export ran on the tracking thread, and the process waited for it before it reported
    assert s["tracking_s"]["models"] > 0 and s["phases_s"]["close_wait"] >= 0 and len(s["model_versions"]) == 2
    assert s["phases_s"]["tracker"] < 0.5  # the flow did not open the store itself

    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    from flockfl.state import load_latest

    client = MlflowClient(uri(project))
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["flockfl.state_sha256"] == s["state_sha256"]
    assert json.loads((project / "runs/full/run.json").read_text())["finished"] is True
    assert _versions(client, s["run_id"]) == {"0": [s["model_versions"][0]], "1": [s["model_versions"][1]]}
    state = load_latest(project / "runs/full")[0]
    assert state.driver.mlflow_run_id == s["run_id"]  # the checkpoint names the run a resume continues
    mlflow.set_tracking_uri(uri(project))
    for j, version in enumerate(s["model_versions"]):
        net = mlflow.pytorch.load_model(f"models:/flockfl-fc/{version}")
        for name, p in net.state_dict().items():
            assert torch.equal(p, state.models[name][j])
    steps = sorted(m.step for m in client.get_metric_history(s["run_id"], "round"))
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_kill_during_the_export_leaves_a_run_that_resume_finishes_without_duplicates(project):
    """SIGKILL between logging model cluster_1 and registering it (the drill's ``1:export``):
    the run is not marked finished, its MLflow run is not FINISHED; ``flockfl resume`` keeps
    cluster_0's version and cluster_1's logged model, registers cluster_1 once, and ends
    bit-identical to an uninterrupted run."""
    from mlflow.tracking import MlflowClient

    full = run_flock(["run", "fc.yaml", "--run-dir", "runs/ref", "--json", "--tracking-uri", uri(project)], project)
    assert full.returncode == 0, full.stderr
    killed = run_flock(["run", "fc.yaml", "--run-dir", "runs/killed", "--json", "--tracking-uri", uri(project)], project,
                       env={"FLOCKFL_CRASH_AT": "1:export"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    info = json.loads((project / "runs/killed/run.json").read_text())
    assert not info.get("finished")
    client = MlflowClient(uri(project))
    run = client.get_run(info["mlflow_run_id"])
    assert run.info.status == "RUNNING"
    assert _logged(client, run) == ["cluster_0", "cluster_1"] and set(_versions(client, run.info.run_id)) == {"0"}

    resumed = run_flock(["resume", "runs/killed", "--json"], project)
    assert resumed.returncode == 0, resumed.stderr
    s = last_json(resumed.stdout)
    assert s["run_id"] == run.info.run_id and s["state_sha256"] == last_json(full.stdout)["state_sha256"]
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and json.loads((project / "runs/killed/run.json").read_text())["finished"]
    assert _logged(client, run) == ["cluster_0", "cluster_1"]  # nothing logged twice
    versions = _versions(client, run.info.run_id)
    assert {k: len(v) for k, v in versions.items()} == {"0": 1, "1": 1}
    assert s["model_versions"] == [versions["0"][0], versions["1"][0]]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "round")) == [1, 2, 3]


# a real MLflow SQLite store (2-9 s in the parallel suite): the full suite's, as the marker says
@pytest.mark.slow
def test_background_calls_run_in_order_and_a_failure_stops_finished(tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.tracking.background import BackgroundTracker, TrackingSkipped

    uri_ = f"sqlite:///{tmp_path}/mlflow.db"
    opened = []
    t = BackgroundTracker(uri_, "bg", "a", params={"x": 1}, on_open=lambda tr: opened.append(tr.run_id))
    t.log_rounds([{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.6}])
    t.log_rounds([{"round": 2, "accuracy": 9.0}])  # already logged: skipped
    assert opened == [t.run_id]
    bad = t.log_artifact(tmp_path / "missing.txt")  # no such file: this call fails
    skipped = t.log_values({"after": 1.0})
    finished = t.finish("FINISHED")
    failed = t.finish("FAILED")
    with pytest.raises(Exception) as err:
        t.close()
    assert bad.exception() is err.value
    assert isinstance(skipped.exception(), TrackingSkipped) and isinstance(finished.exception(), TrackingSkipped)
    assert failed.exception() is None
    client = MlflowClient(uri_)
    run = client.get_run(t.run_id)
    assert run.info.status == "FAILED" and run.data.params == {"x": "1"} and "after" not in run.data.metrics
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "accuracy")] == [(1, 0.5), (2, 0.6)]
    assert set(t.seconds) >= {"open", "log_rounds", "log_artifact", "finish"}


@pytest.mark.slow  # a real MLflow SQLite store
def test_rounds_queued_while_the_tracker_is_busy_go_in_one_transaction(tmp_path):
    """A stack's cells log faster than the store commits: rows queued behind a busy call are taken
    by the first log_rounds call (one log_batch, i.e. one SQLite transaction, for all of them, split
    at row boundaries at 1,000 metrics); the later calls find none, and every round is logged once."""
    import threading

    from mlflow.tracking import MlflowClient

    from flows.tracking.background import BackgroundTracker

    uri_ = f"sqlite:///{tmp_path}/mlflow.db"
    t = BackgroundTracker(uri_, "bg", "a")
    batches = []
    t.submit(lambda tr: batches.append(tr.client.log_batch)).result()  # the real client's method

    def counting(run_id, metrics=(), **kw):
        batches.append(len(metrics))
        return batches[0](run_id, metrics=metrics, **kw)

    t.submit(lambda tr: setattr(tr.client, "log_batch", counting)).result()
    gate = threading.Event()
    t.submit(lambda tr: gate.wait(30))  # the thread busy (an export, say)
    wide = {f"m{i}": float(i) for i in range(300)}  # 302 metrics a row (with round, accuracy): 3 fit in 1,000
    for r in range(1, 8):
        t.log_rounds([{"round": r, "accuracy": r / 10, **wide}])
    t.log_rounds([{"round": 3, "accuracy": 9.0}])  # already queued: not logged twice
    gate.set()
    t.close()
    assert batches[1:] == [906, 906, 302], batches[1:]  # rounds 1-3, 4-6, 7
    client = MlflowClient(uri_)
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "accuracy")] == \
        [(r, r / 10) for r in range(1, 8)]
    assert len(client.get_metric_history(t.run_id, "m299")) == 7


def test_a_tracker_whose_store_cannot_open_fails_where_the_run_asks(tmp_path):
    from flows.tracking.background import BackgroundTracker

    (tmp_path / "file").write_text("")
    t = BackgroundTracker(f"sqlite:///{tmp_path}/file/mlflow.db", "bg", "a")  # a folder that is a file
    with pytest.raises(Exception):
        t.run_id
    t.finish("FAILED")  # nothing to mark: skipped, no second error
    t.close(raise_errors=False)
    with pytest.raises(Exception):
        t.check()


# a real MLflow SQLite store (2-5 s): the full suite's
@pytest.mark.slow
def test_prefetch_opens_an_existing_store_and_never_creates_one(tmp_path):
    from flows.tracking.store import open_store, prefetch

    new = tmp_path / "new" / "mlflow.db"
    prefetch(f"sqlite:///{new}").join(60)
    assert not new.exists()
    old = tmp_path / "old.db"
    open_store(f"sqlite:///{old}")
    assert prefetch(f"sqlite:///{old}").join(60) is None and old.exists()
    assert prefetch(f"sqlite:///{old}") is prefetch(f"sqlite:///{old}")  # once per store and process


def test_the_requirements_check_is_skipped_only_inside_the_export():
    import mlflow.pyfunc
    import mlflow.utils.environment

    from flows.tracking.export import _own_requirements

    before = (mlflow.utils.environment.warn_dependency_requirement_mismatches,
              mlflow.pyfunc.warn_dependency_requirement_mismatches)
    with _own_requirements():
        assert mlflow.utils.environment.warn_dependency_requirement_mismatches(["torch==0.0.1"]) is None
        assert mlflow.pyfunc.warn_dependency_requirement_mismatches is not before[1]
    assert (mlflow.utils.environment.warn_dependency_requirement_mismatches,
            mlflow.pyfunc.warn_dependency_requirement_mismatches) == before


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn_bn"])
def test_both_model_formats_load_back_through_the_run_and_the_registry(tmp_path, model):
    """``tracking.model_format``: pt2 and pickle give the same outputs through ``runs:/`` and
    ``models:/NAME/VERSION``; pickle gives back the model's own class (it trains: ``train()`` and
    a backward pass), pt2 a GraphModule that only infers."""
    import mlflow
    import mlflow.pytorch

    from models import build_model
    from flows.tracking.tracker import Tracker

    shape = (1, 8, 8) if model == "mlp" else (1, 28, 28)
    torch.manual_seed(0)
    net = build_model(model, shape, 10, 16).eval()
    stacked = {n: torch.stack([p.detach() + 0.01 * k if p.is_floating_point() else p for k in range(2)])
               for n, p in net.state_dict().items()}
    x = torch.randn(3, *shape)
    uri_ = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri_)
    for fmt in ("pt2", "pickle"):
        t = Tracker(uri_, "formats", fmt)
        versions = t.log_models(net, stacked, f"fmt-{fmt}", x[:2].numpy(), fmt)
        t.finish()
        assert versions == ["1", "2"]
        for j in range(2):
            want = build_model(model, shape, 10, 16).eval()
            want.load_state_dict({n: v[j] for n, v in stacked.items()})
            for source in (f"runs:/{t.run_id}/cluster_{j}", f"models:/fmt-{fmt}/{versions[j]}"):
                got = mlflow.pytorch.load_model(source)
                np.testing.assert_allclose(got(x).detach().numpy(), want(x).detach().numpy(), rtol=0, atol=1e-6)
                assert set(got.state_dict()) == set(want.state_dict())
                if fmt == "pickle":
                    assert type(got) is type(want)
                    got.train()
                    got(x).sum().backward()
                else:
                    assert isinstance(got, torch.fx.GraphModule)
                    with pytest.raises(NotImplementedError):
                        got.train()
