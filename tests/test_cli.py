"""The `flockfl` command line: config errors are one line with exit code 2; list and partition."""

from __future__ import annotations

import json

import pytest

from flows.cli import main

from conftest import run_flock


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


BAD = [
    (["run", "ifca_rotated_digits", "--set", "train.bogus=1"], "unknown key 'train.bogus'"),
    (["run", "ifca_rotated_digits", "--set", "train.lr=fast"], "train.lr"),
    (["run", "ifca_rotated_digits", "--set", "train.lr=-1"], "train.lr"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedmagic"], "unknown algorithm 'fedmagic'"),
    (["run", "ifca_rotated_digits", "--set", "dataset.name=imagenet"], "dataset.name"),
    (["run", "ifca_rotated_digits", "--set", "partition.scheme=shards", "--set", "partition.num_clients=1000",
      "--set", "partition.classes_per_client=5", "--set", "train.clients_per_round=10"], "shards but only"),
    (["run", "ifca_rotated_digits", "--set", "train.clients_per_round=99"], "exceeds partition.num_clients"),
    (["run", "no_such_experiment"], "unknown experiment 'no_such_experiment'"),
    (["run", "ifca_rotated_digits", "--set", "model.name=linear"], "regression model"),
    (["run", "ifca_rotated_digits", "--set", "noequals"], "expected key=value"),
    (["resume", "/nonexistent/run"], "neither a run directory"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedprox", "--set", "algorithm.mu=-1"], "algorithm.mu"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedadam", "--set", "algorithm.beta2=1.5"], "algorithm.beta2"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedavgm", "--set", "algorithm.momentum=1"], "allowed: 0 ≤ x < 1"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedyogi", "--set", "algorithm.tau=0"], "algorithm.tau"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=scaffold", "--set", "algorithm.option=III"], "allowed: one of II, I"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.option=II"], "not allowed for ifca; allowed: one of model, gradient"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1][:30] for b in BAD])
def test_config_errors_exit_2_with_one_line(in_workdir, capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (in_workdir / "runs").exists()  # nothing was started


def test_real_process_prints_no_traceback(workdir):
    res = run_flock(["run", "ifca_rotated_digits", "--set", "algorithm.k=zero"], workdir, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("flockfl: error: config error: algorithm.k")
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1


def test_missing_dataset_is_one_line(in_workdir, capsys, monkeypatch):
    import flockfl.data.datasets as dsmod

    monkeypatch.setitem(dsmod.SYSTEM_DIRS, "mnist", str(in_workdir / "none"))
    assert main(["run", "ifca_rotated_digits", "--set", "dataset.name=mnist"]) == 2
    err = capsys.readouterr().err
    assert "IDX files not found" in err and err.count("\n") == 1


def test_list_shows_experiments_and_algorithms(in_workdir, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg_rotated_digits" in out and "ifca_rotated_digits" in out
    algos = next(line for line in out.splitlines() if line.startswith("algorithms:"))
    for name in ("fedavg", "fedsgd", "ifca", "fedprox", "fednova", "scaffold", "fedadam", "fedadagrad", "fedyogi", "fedavgm"):
        assert name in algos.split(": ", 1)[1].split(", ")


def test_partition_command_writes_npz_and_summary(in_workdir, capsys):
    assert main(["partition", "rotated_digits", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_clients"] == 40 and not out["cached"]
    summary = json.loads((in_workdir / "data/partitions/rotated_digits.json").read_text())
    assert summary["groups"] == [g for g in range(4) for _ in range(10)]
    assert (in_workdir / "data/partitions/rotated_digits.npz").exists()
    assert main(["partition", "rotated_digits", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cached"]


def test_switching_algorithm_drops_foreign_keys_with_a_notice(in_workdir, capsys):
    """--set algorithm.name=X on a config written for Y (the IFCA config's own header suggests
    it): Y's keys that X does not take are dropped with a one-line notice, not an error."""
    from flockfl.experiments import load_experiment

    cfg = load_experiment("ifca_rotated_digits", ["algorithm.name=fedprox", "algorithm.mu=0.5"])
    err = capsys.readouterr().err
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.mu == 0.5
    assert cfg.algorithm.hyper() == {"weighting": "samples", "mu": 0.5}
    assert err.count("\n") == 1 and "dropped algorithm.init, algorithm.k" in err


def test_a_regression_npz_with_the_linear_model_runs_and_natural_clients_come_from_the_file(tmp_path):
    """Review fixes: the data decides regression vs classification (float labels are regression),
    and with scheme=natural the number of clients comes from the file."""
    import numpy as np

    from flockfl.errors import ConfigError
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    rng = np.random.default_rng(0)
    x, xt = rng.normal(size=(60, 3)).astype(np.float32), rng.normal(size=(30, 3)).astype(np.float32)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    path = tmp_path / "reg.npz"
    np.savez(path, x_train=x, y_train=x @ w, x_test=xt, y_test=xt @ w,
             client_train=np.repeat(np.arange(6), 10), client_test=np.repeat(np.arange(6), 5))
    raw = {"dataset": {"name": "npz", "path": str(path)}, "partition": {"scheme": "natural"},
           "model": {"name": "linear"}, "train": {"rounds": 2, "clients_per_round": 3, "lr": 0.05},
           "tracking": {"enabled": False}}
    cfg = validate(raw)
    assert cfg.partition.num_clients is None
    prep = prepare(cfg, tmp_path / "parts")
    assert prep.ctx.num_clients == 6 and prep.ctx.data.task == "regression"
    assert np.isfinite(run_rounds(prep).history[-1]["loss"])
    with pytest.raises(ConfigError, match="model.name: 'mlp' is a classifier; dataset 'npz' has float labels"):
        prepare(validate({**raw, "model": {"name": "mlp"}}), tmp_path / "parts")
    with pytest.raises(ConfigError, match="train.clients_per_round: 8 exceeds the 6 clients"):
        prepare(validate({**raw, "train": {"clients_per_round": 8}}), tmp_path / "parts")
