"""`dvc repro` and `dvc exp run -S` on the repo's dvc.yaml with a tiny params file, in a
temp git repo (real git, real DVC, no remote)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, flock_env

pytestmark = pytest.mark.slow

PARAMS = {
    "partitions": {"tiny_rot": {"seed": 0, "dataset": {"name": "digits"},
                                "partition": {"scheme": "rotated", "num_clients": 8, "k": 2}}},
    "experiments": {"tiny_ifca": {"partition": {"name": "tiny_rot"}, "model": {"name": "mlp", "hidden": 16},
                                  "algorithm": {"name": "ifca", "k": 2},
                                  "train": {"rounds": 2, "clients_per_round": 4, "batch_size": 10, "lr": 0.1},
                                  "tracking": {"register_model": False}}},
}


def sh(args, cwd, env, check=True):
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return res


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("dvcrepo")
    shutil.copy(ROOT / "dvc.yaml", d / "dvc.yaml")
    (d / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    (d / ".gitignore").write_text("mlflow.db\nmlruns/\nruns/\n.prefect/\n/metrics/\n")
    env = flock_env({"MLFLOW_TRACKING_URI": f"sqlite:///{d}/mlflow.db", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                     "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    dvc = [sys.executable, "-m", "dvc"]
    sh(["git", "init", "-q"], d, env)
    sh(dvc + ["init", "-q"], d, env)
    sh(["git", "add", "-A"], d, env)
    sh(["git", "commit", "-qm", "init"], d, env)
    return d, env, dvc


def test_dvc_repro_without_the_venv_activated(tmp_path):
    """`.venv/bin/dvc repro` from a shell whose PATH has no venv: the stage commands still find
    the project's flockfl (in .venv/bin), not another program of that name."""
    import os

    d = tmp_path / "proj"
    d.mkdir()
    shutil.copy(ROOT / "dvc.yaml", d / "dvc.yaml")
    (d / "params.yaml").write_text(yaml.safe_dump({"partitions": PARAMS["partitions"], "experiments": {}}))
    (d / ".venv").symlink_to(sys.prefix)  # the project's venv, as ./run makes it
    env = flock_env({"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    env.pop("VIRTUAL_ENV", None)
    assert shutil.which("flockfl", path=env["PATH"]) is None
    sh(["git", "init", "-q"], d, env)
    sh([str(d / ".venv/bin/dvc"), "init", "-q"], d, env)
    res = sh([str(d / ".venv/bin/dvc"), "repro"], d, env)
    assert (d / "data/partitions/tiny_rot.npz").stat().st_size > 0, res.stdout


def test_dvc_repro_runs_partition_then_train(repo):
    d, env, dvc = repo
    sh(dvc + ["repro"], d, env)
    assert (d / "data/partitions/tiny_rot.npz").exists()
    metrics = json.loads((d / "metrics/tiny_ifca.json").read_text())
    assert metrics["rounds"] == 2 and 0 <= metrics["accuracy"] <= 1 and "ari" in metrics
    lock = yaml.safe_load((d / "dvc.lock").read_text())
    assert {"partition@tiny_rot", "train@tiny_ifca"} <= set(lock["stages"])
    # nothing changed: both stages are skipped
    again = sh(dvc + ["repro"], d, env)
    assert "didn't change, skipping" in again.stdout + again.stderr
    shown = json.loads(sh(dvc + ["metrics", "show", "--json"], d, env).stdout)
    assert "metrics/tiny_ifca.json" in json.dumps(shown)


def test_dvc_exp_run_with_set_override(repo):
    d, env, dvc = repo
    sh(["git", "add", "-A"], d, env)
    sh(["git", "commit", "-qm", "baseline", "--allow-empty"], d, env)
    sh(dvc + ["exp", "run", "-S", "experiments.tiny_ifca.train.rounds=3"], d, env)
    metrics = json.loads((d / "metrics/tiny_ifca.json").read_text())
    assert metrics["rounds"] == 3
    # the partition stage did not re-run: its params did not change
    show = sh(dvc + ["exp", "show", "--json"], d, env).stdout
    assert "experiments.tiny_ifca.train.rounds" in show or "rounds" in show
