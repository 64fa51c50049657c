"""The `flock` command line: config errors are one line with exit code 2; list and partition."""

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
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedavgm", "--set", "algorithm.momentum=1"], "less than 1"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=fedyogi", "--set", "algorithm.tau=0"], "algorithm.tau"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=scaffold", "--set", "algorithm.option=III"], "allowed: II, I"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.option=II"], "not an option of ifca"),
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
    assert res.stderr.strip().startswith("flock: error: config error: algorithm.k")
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
