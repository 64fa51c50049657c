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
    (["sweep", "ifca_rotated_digits", "--parallel", "0"], "--parallel 0: give a positive number of processes"),
    (["sweep", "ifca_rotated_digits", "--stack-size", "0"], "--stack-size 0: give a positive number of cells"),
    (["repro", "niid_bench_fmnist", "--parallel", "-1"], "--parallel -1: give a positive number of processes"),
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
    import flockfl.data.images as dsmod

    monkeypatch.setitem(dsmod.SYSTEM_DIRS, "mnist", str(in_workdir / "none"))
    assert main(["run", "ifca_rotated_digits", "--set", "dataset.name=mnist"]) == 2
    err = capsys.readouterr().err
    assert "IDX files not found" in err and err.count("\n") == 1


def test_list_shows_experiments_and_algorithms_by_family(in_workdir, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg_rotated_digits" in out and "ifca_rotated_digits" in out
    families = {line.split()[0]: line.split(None, 1)[1].split(", ") for line in out.splitlines()
                if line.startswith("  ") and line.split()[0] in ("global", "clustered", "personalised")}
    for name in ("fedavg", "fedsgd", "fedprox", "fednova", "scaffold", "fedadam", "fedadagrad", "fedyogi", "fedavgm"):
        assert name in families["global"]
    assert {"ifca", "pacfl", "cfl", "flexcfl"} <= set(families["clustered"])
    assert {"ditto", "apfl", "fedrep", "local"} <= set(families["personalised"])
    assert main(["list", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert sorted(sum(js["families"].values(), [])) == js["algorithms"]  # every method in exactly one family


@pytest.mark.parametrize("what,name", [("datasets", "digits"), ("schemes", "dirichlet"), ("models", "lenet5"),
                                       ("experiments", "ifca_rotated_digits"), ("partitions", "rotated_digits"),
                                       ("stages", "pruning"), ("algorithms", "pacfl")])
def test_list_each_kind(in_workdir, capsys, what, name):
    assert main(["list", what]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[0] == name for line in lines), lines
    assert main(["list", what, "--json"]) == 0
    assert name in json.loads(capsys.readouterr().out)[what]


def test_configs_are_found_from_a_subfolder_and_not_outside_a_project(in_workdir, tmp_path_factory, capsys, monkeypatch):
    """params.yaml is found by walking up (as git and dvc find theirs); the project's defaults
    (data/partitions, runs/) are the root's; outside a project the error names where it looked."""
    sub = in_workdir / "notes" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert main(["list", "experiments"]) == 0
    assert "ifca_rotated_digits" in capsys.readouterr().out
    assert main(["partition", "rotated_digits", "--json"]) == 0
    assert (in_workdir / "data/partitions/rotated_digits.npz").exists() and not (sub / "data").exists()
    outside = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(outside)
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no params.yaml in {outside.resolve()} or any folder above it" in err
    assert main(["run", "ifca_rotated_digits"]) == 2
    assert "no params.yaml in" in capsys.readouterr().err
    assert main(["list", "algorithms"]) == 0  # what needs no project works anywhere
    capsys.readouterr()
    assert main(["list", "--params", "misspelt.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--params" in err and "misspelt.yaml: no such file" in err
    assert main(["list", "experiments", "--params", str(in_workdir / "params.yaml")]) == 0
    assert "ifca_rotated_digits" in capsys.readouterr().out


@pytest.mark.parametrize("argv,hint", [
    (["run", "ifca_rotated_digits", "--set", "train.lrr=0.1"], "did you mean 'train.lr'?"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.kk=3"], "did you mean 'algorithm.k'?"),
    (["run", "ifca_rotated_digits", "--set", "algorithm.name=ifac"], "did you mean 'ifca'?"),
    (["run", "ifca_rotated_digits", "--set", "model.name=mpl"], "did you mean 'mlp'?"),
    (["run", "ifca_rotated_digit"], "did you mean 'ifca_rotated_digits'?"),
    (["list", "fedavgg"], "did you mean 'fedavg'?"),
    (["list", "FedProx"], "did you mean 'fedprox'?"),
])
def test_did_you_mean(in_workdir, capsys, argv, hint):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and err.count("\n") == 1, err


@pytest.mark.slow  # two whole flockfl runs (59 s in the parallel suite): the full suite's, not the fast tier's
def test_summary_is_short_and_a_log_gets_a_line_per_round(workdir):
    """Without a terminal, each round is one line (a log reads as a log); the summary that
    follows is at most ~12 lines; --json keeps everything, and its progress goes to stderr."""
    args = ["run", "fedavg_rotated_digits", "--set", "train.rounds=3", "--set", "partition.num_clients=8",
            "--set", "train.clients_per_round=4", "--tracking-uri", f"sqlite:///{workdir}/m.db"]
    res = run_flock([*args, "--run-dir", "runs/a"], workdir, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    rounds = [line for line in lines if " round " in line and "/3 " in line]
    assert len(rounds) == 3 and all("accuracy=" in line for line in rounds), lines
    summary = lines[len(rounds):]
    assert summary[0].startswith("fedavg_rotated_digits: fedavg 3 rounds") and len(summary) <= 12, summary
    assert any(line.split()[0] == "accuracy" for line in summary)
    res = run_flock([*args, "--run-dir", "runs/b", "--json"], workdir, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") == 1 and json.loads(res.stdout)["algorithm"] == "fedavg"
    assert res.stderr.count(" round ") == 3
    # nothing stray in the project's root: the store's lock lives in a per-user folder
    left = {p.name for p in workdir.iterdir()}
    assert left <= {"params.yaml", "data", "runs", "m.db", "mlruns", ".prefect"}, left


def test_partition_command_writes_npz_and_summary(in_workdir, capsys):
    assert main(["partition", "rotated_digits", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_clients"] == 40 and not out["cached"]
    summary = json.loads((in_workdir / "data/partitions/rotated_digits.json").read_text())
    assert summary["groups"] == [g for g in range(4) for _ in range(10)]
    assert (in_workdir / "data/partitions/rotated_digits.npz").exists()
    assert main(["partition", "rotated_digits", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cached"]


def test_switching_algorithm_drops_the_old_keys_and_names_the_run_after_it(in_workdir, capsys):
    """--set algorithm.name=X on a config written for Y (the IFCA config's own header suggests
    it): every algorithm.* key the config set for Y is dropped with a one-line notice (X runs with
    its own defaults and the keys given beside the name), and the run, its directory and its
    registered model carry X's name, filed under the experiment's MLflow experiment."""
    from flockfl.experiments import load_experiment

    cfg = load_experiment("ifca_rotated_digits", ["algorithm.name=fedprox", "algorithm.mu=0.5"])
    err = capsys.readouterr().err
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.mu == 0.5
    assert cfg.algorithm.hyper() == {"weighting": "samples", "mu": 0.5}
    assert err.count("\n") == 1 and "dropped ifca's algorithm.init, algorithm.k" in err
    assert cfg.name == "ifca_rotated_digits-fedprox" and cfg.tracking.experiment == "ifca_rotated_digits"
    # a key both algorithms take is dropped too unless given again: one-shot IFCA runs with its own
    # default k = 2, not the IFCA experiment's 4
    cfg = load_experiment("ifca_rotated_digits", ["algorithm.name=ifca_oneshot"])
    assert cfg.algorithm.hyper()["k"] == 2
    cfg = load_experiment("ifca_rotated_digits", ["algorithm.name=ifca_oneshot", "algorithm.k=4"])
    assert cfg.algorithm.hyper()["k"] == 4
    # naming the run yourself wins
    assert load_experiment("ifca_rotated_digits", ["algorithm.name=fedavg", "name=mine"]).name == "mine"


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
