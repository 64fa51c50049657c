"""Plugins (docs/plugins.md): the documented example, extracted from the doc, registers a method, a
model, a scheme and a data set through FLOCKFL_PLUGINS and through entry points; `flockfl list`
shows them, configs naming them validate (the method's own key as a built-in's), both trainers
and a worker process run them, a killed run resumes; a plugin that cannot load, or takes a name
that is taken, is one line naming it and the fix."""

from __future__ import annotations

import json
import pickle
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, flock_env, last_json, run_flock, tiny_config

DOC = ROOT / "docs" / "plugins.md"
MODULE = "my_fl_plugins"
NAMES = {"algorithm": "trimmed_mean", "model": "tiny_cnn", "scheme": "quantity_skew", "dataset": "blobs"}


def doc_files() -> dict[str, str]:
    """The doc's example files: each fenced block right after a ``<!-- file: NAME -->`` line."""
    return dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), re.S))


def write_example(folder: Path, *names: str) -> Path:
    files = doc_files()
    folder.mkdir(parents=True, exist_ok=True)
    for name in names or files:
        (folder / name).write_text(files[name])
    return folder


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """A process with no plugin loaded, before and after: the registries hold their built-ins
    only, and the plugin modules a test imported (all in its temp folder) are forgotten, so that
    the next import runs them again."""
    from flockfl import plugins

    monkeypatch.delenv(plugins.ENV, raising=False)
    path = list(sys.path)
    plugins._forget()
    yield plugins
    plugins._forget()
    sys.path[:] = path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def example(tmp_path, monkeypatch, clean):
    """The doc's module in a folder that is the current one, named by FLOCKFL_PLUGINS."""
    folder = write_example(tmp_path / "plugin", MODULE + ".py", "trimmed.yaml")
    monkeypatch.chdir(folder)
    monkeypatch.setenv(clean.ENV, MODULE)
    return folder


def _registries():
    from flockfl.algorithms import ALGORITHMS
    from flockfl.data.datasets import LOADERS
    from flockfl.data.schemes import SCHEMES
    from models import MODELS

    return {"algorithm": ALGORITHMS, "model": MODELS, "dataset": LOADERS, "scheme": SCHEMES}


# ---------------------------------------------------------------------- the doc's example


def test_the_doc_holds_the_example_files():
    files = doc_files()
    assert set(files) == {MODULE + ".py", "trimmed.yaml", "pyproject.toml"}
    compile(files[MODULE + ".py"], MODULE + ".py", "exec")
    assert 'name = "trimmed_mean"' in files[MODULE + ".py"]


def test_flockfl_plugins_registers_every_kind_and_validation_sees_them(example):
    from flockfl.algorithms import describe
    from flockfl.errors import ConfigError
    from flockfl.experiments import load_experiment, parse_set, validate

    regs = _registries()
    for kind, name in NAMES.items():
        assert name in regs[kind], kind
        assert regs[kind].origin(name) == f"plugin {MODULE!r} (FLOCKFL_PLUGINS)"
    assert regs["algorithm"].origin("fedavg") == "built-in" and "trimmed_mean" not in regs["algorithm"].builtins()
    d = describe("trimmed_mean")
    keys = {h["key"]: h for h in d["hyperparameters"]}
    assert d["stages"] == ["aggregate"] and d["origin"].endswith("(FLOCKFL_PLUGINS)")
    assert keys["algorithm.trim"]["default"] == 0.1 and keys["algorithm.trim"]["allowed"] == "0 ≤ x < 0.5"
    # the doc's config loads; the method's key is checked and defaulted as a built-in's
    cfg = load_experiment(str(example / "trimmed.yaml"))
    assert (cfg.algorithm.name, cfg.algorithm.trim, cfg.model.name, cfg.partition.scheme) == (
        "trimmed_mean", 0.2, "tiny_cnn", "quantity_skew")
    assert validate(tiny_config(algorithm={"name": "trimmed_mean"})).algorithm.trim == 0.1
    assert parse_set(["algorithm.trim=0.3"]) == {"algorithm": {"trim": 0.3}}
    for over, needle in (({"trim": 0.5}, r"algorithm.trim: 0.5 is not allowed for trimmed_mean; allowed: 0 ≤ x < 0.5"),
                         ({"mu": 0.1}, r"algorithm.mu: trimmed_mean does not take 'mu'; it is a hyper-parameter of")):
        with pytest.raises(ConfigError, match=needle) as err:
            validate(tiny_config(algorithm={"name": "trimmed_mean", **over}))
        assert "\n" not in str(err.value)
    # an unknown name lists the plugins' names beside the built-ins
    with pytest.raises(ConfigError, match=r"model.name: Input should be 'mclr'.* or 'tiny_cnn'") as err:
        validate(tiny_config(model={"name": "tiny_cnm"}))
    assert "\n" not in str(err.value)
    # a plugin data set: its labels decide classification (the schema does not refuse it)
    assert validate(tiny_config(dataset={"name": "blobs"}, partition={"scheme": "quantity_skew"})).dataset.name == "blobs"


def test_both_trainers_run_the_plugins_alike(example, tmp_path):
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    for over in ({"model": {"name": "tiny_cnn"}, "partition": {"scheme": "quantity_skew", "num_clients": 10}},
                 {"dataset": {"name": "blobs"}, "partition": {"scheme": "iid", "num_clients": 10}}):
        states = {}
        for engine in ("reference", "vectorized"):
            cfg = validate(tiny_config(algorithm={"name": "trimmed_mean", "trim": 0.2}, **over,
                                       train={"engine": engine, "clients_per_round": 5, "rounds": 2}))
            prep = prepare(cfg, tmp_path / "parts")
            assert type(prep.algorithm).__module__ == MODULE
            states[engine] = run_rounds(prep)
        ref, vec = states["reference"].models, states["vectorized"].models
        for k in ref:
            torch.testing.assert_close(ref[k], vec[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(ref[k], prep.algorithm.init_state(prep.ctx).models[k])  # it trained


def test_the_trimmed_mean_drops_the_extremes(example):
    """The example's aggregate is what its docstring says: 5 clients, β = 0.2 drops one each side."""
    from flockfl.algorithms import build_algorithm
    from flockfl.engine import TrainResult
    from flockfl.experiments import validate
    from flockfl.state import ServerState

    alg = build_algorithm(validate(tiny_config(algorithm={"name": "trimmed_mean", "trim": 0.2})))
    values = torch.tensor([[1.0, -9.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0], [-50.0, 3.0]])
    state = ServerState(round=0, models={"w": torch.zeros(1, 2)}, assignments=np.zeros(5, np.int64),
                        assignment_history=np.zeros((0, 5), np.int64), meta={})
    result = TrainResult(np.arange(5), {"w": values}, np.full(5, 10), np.ones(5), np.zeros(5))
    new = alg.aggregate(state, None, None, result, np.zeros(5, np.int64))
    torch.testing.assert_close(new.models["w"], torch.tensor([[2.0, 1.0]]))  # means of {1,2,3} and {0,1,2}


# a worker process of its own (5-6 s): the full suite's; the fast tier keeps the in-process plugin tests
@pytest.mark.slow
def test_a_worker_process_loads_the_plugins_itself(example, tmp_path):
    """A Dask worker is a fresh process that rebuilds the run from the job's config: told of the
    plugins by the environment (as LocalCluster's workers inherit it), it trains the shard as the
    flow would."""
    from flockfl import rounds, training
    from flockfl.executor import ShardJob, context_key, pack, unpack_result
    from flockfl.experiments import load_experiment

    cfg = load_experiment(str(example / "trimmed.yaml"))
    prep = rounds.prepare(cfg, tmp_path / "parts")
    state, spec = rounds.select_stage(prep, prep.algorithm.init_state(prep.ctx), 0)
    # the worker at the flow's thread count: the bits of some reductions (channels-last convolutions) depend on it
    job = ShardJob(config=cfg.model_dump(), context_key=context_key(cfg), data_root=str(tmp_path / "parts"),
                   partition_hash=prep.partition_hash, shift=None, spec=spec, engine="vectorized", round=0,
                   threads=torch.get_num_threads())
    (tmp_path / "job.pkl").write_bytes(pack(job))
    code = ("import sys; from flockfl.executor import run_job; from flockfl import plugins; "
            "out = run_job(open(sys.argv[1], 'rb').read()); open(sys.argv[2], 'wb').write(out); print(plugins.loaded())")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pkl"), str(tmp_path / "out.pkl")],
                         cwd=example, env=flock_env({"FLOCKFL_PLUGINS": MODULE}), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"plugin {MODULE!r} (FLOCKFL_PLUGINS)" in res.stdout
    out, _ = unpack_result((tmp_path / "out.pkl").read_bytes(), torch.device("cpu"))
    ref = training.train_shard(prep.ctx, spec, "vectorized", 0, tuple(prep.stages.values()))
    assert np.array_equal(out.clients, ref.clients)
    assert all(torch.equal(out.params[k], ref.params[k]) for k in ref.params)


# ---------------------------------------------------------------------- entry points


def _install(site: Path, dist: str, module_files: dict[str, str], entry_points: dict[str, dict[str, str]]) -> None:
    """A distribution as pip leaves it: the modules, and a dist-info with its entry points."""
    site.mkdir(parents=True, exist_ok=True)
    for name, text in module_files.items():
        (site / name).write_text(text)
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in entry_points.items()))


def test_the_documented_entry_points_register_the_example(tmp_path, monkeypatch, clean):
    project = tomllib.loads(doc_files()["pyproject.toml"])
    entry_points = project["project"]["entry-points"]
    assert set(entry_points) == set(clean.GROUPS.values())  # the four groups of the contract
    _install(tmp_path / "site", project["project"]["name"], {MODULE + ".py": doc_files()[MODULE + ".py"]}, entry_points)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    regs = _registries()
    for kind, name in NAMES.items():
        assert name in regs[kind]
        assert regs[kind].origin(name).startswith("plugin"), regs[kind].origin(name)
    origin = regs["algorithm"].origin("trimmed_mean")
    assert "entry point" in origin or MODULE in origin
    assert any("group flockfl.algorithms of my-fl-plugins" in s for s in clean.loaded()), clean.loaded()
    from flockfl.experiments import validate

    cfg = validate(tiny_config(algorithm={"name": "trimmed_mean"}, model={"name": "tiny_cnn"},
                               partition={"scheme": "quantity_skew"}))
    assert cfg.algorithm.trim == 0.1


def test_an_entry_point_may_name_a_module_that_registers_itself(tmp_path, monkeypatch, clean):
    _install(tmp_path / "site", "modplug", {"modplug.py": "from flockfl.plugins import register_model\n"
                                            "from torch import nn\n\n"
                                            "@register_model(name='flat_linear')\n"
                                            "def build(input_shape, num_outputs, hidden=200):\n"
                                            "    import math\n"
                                            "    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_outputs))\n"},
             {"flockfl.models": {"modplug": "modplug"}})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    from models import MODELS, build_model

    assert "flat_linear" in MODELS and "modplug" not in MODELS
    assert build_model("flat_linear", (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


# ---------------------------------------------------------------------- errors, one line each


def _plugin_error(clean, read=lambda: "fedavg" in _registries()["algorithm"]) -> str:
    with pytest.raises(clean.PluginError) as err:
        read()
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_a_module_that_is_not_there(tmp_path, monkeypatch, clean):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(clean.ENV, "nope_not_a_module")
    msg = _plugin_error(clean)
    assert msg.startswith("plugin 'nope_not_a_module' (FLOCKFL_PLUGINS): no module 'nope_not_a_module' in ")
    assert "remove it from FLOCKFL_PLUGINS" in msg
    # every later read says it again: no run starts without the plugins it was told of
    assert _plugin_error(clean) == msg
    monkeypatch.setenv(clean.ENV, "my_plugins.py")
    clean._forget()
    assert "takes module names, not files; set FLOCKFL_PLUGINS=my_plugins" in _plugin_error(clean)


def test_a_module_that_fails_to_import(tmp_path, monkeypatch, clean):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_plugin.py").write_text("import math\nx = 1 / 0\n")
    (tmp_path / "needy_plugin.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.setenv(clean.ENV, "broken_plugin")
    msg = _plugin_error(clean)
    assert msg == ("plugin 'broken_plugin' (FLOCKFL_PLUGINS) failed to import: ZeroDivisionError: division by zero "
                   "(broken_plugin.py:2); fix it, or remove it from FLOCKFL_PLUGINS")
    clean._forget()
    monkeypatch.setenv(clean.ENV, "needy_plugin")
    msg = _plugin_error(clean)
    assert "failed to import: ModuleNotFoundError" in msg and "install not_installed_dependency_xyz" in msg


def test_the_command_line_prints_one_line_and_exits_2(tmp_path, monkeypatch, clean, capsys):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(clean.ENV, "nope_not_a_module")
    assert main(["list", "fedavg"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flockfl: error: plugin 'nope_not_a_module' (FLOCKFL_PLUGINS): no module") and "\n" not in err


@pytest.mark.parametrize("kind,code", [
    ("algorithm", "from flockfl.algorithms.base import Algorithm\nfrom flockfl.plugins import register_algorithm\n\n"
                  "@register_algorithm\nclass Mine(Algorithm):\n    name = 'fedavg'\n"),
    ("model", "from flockfl.plugins import register_model\n\n@register_model\ndef mlp(s, n, h=200):\n    return None\n"),
    ("scheme", "from flockfl.plugins import register_scheme\n\n@register_scheme(name='iid')\ndef mine(ds, cfg, seed):\n"
               "    return None\n"),
])
def test_a_name_a_built_in_has_is_an_error(kind, code, tmp_path, monkeypatch, clean):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "clash_plugin.py").write_text(code)
    monkeypatch.setenv(clean.ENV, "clash_plugin")
    taken = {"algorithm": "fedavg", "model": "mlp", "scheme": "iid"}[kind]
    msg = _plugin_error(clean, lambda: len(_registries()[kind]))
    assert msg.startswith(f"plugin 'clash_plugin' (FLOCKFL_PLUGINS): {kind} {taken!r} clashes with flockfl's built-in "
                          f"{kind} of that name; give yours another name")


def test_a_name_taken_twice_an_inherited_name_and_an_unknown_family_are_errors(tmp_path, monkeypatch, clean):
    monkeypatch.chdir(tmp_path)
    for m in ("first_plugin", "second_plugin"):
        (tmp_path / f"{m}.py").write_text("from flockfl.plugins import register_model\n\n@register_model(name='twin')\n"
                                          "def build(s, n, h=200):\n    return None\n")
    monkeypatch.setenv(clean.ENV, "first_plugin,second_plugin")
    assert _plugin_error(clean) == ("plugin 'second_plugin' (FLOCKFL_PLUGINS): model 'twin' is already registered by "
                                    "plugin 'first_plugin' (FLOCKFL_PLUGINS); rename one of them")
    clean._forget()
    (tmp_path / "lazy_plugin.py").write_text("from flockfl.algorithms.fedavg import FedAvg\n"
                                             "from flockfl.plugins import register_algorithm\n\n"
                                             "@register_algorithm\nclass Lazy(FedAvg):\n    pass\n")
    monkeypatch.setenv(clean.ENV, "lazy_plugin")
    assert "algorithm class Lazy inherits name='fedavg'; give it its own class attribute name" in _plugin_error(clean)
    clean._forget()
    (tmp_path / "odd_plugin.py").write_text("from flockfl.algorithms.fedavg import FedAvg\n"
                                            "from flockfl.plugins import register_algorithm\n\n"
                                            "@register_algorithm\nclass Odd(FedAvg):\n    name = 'odd'\n"
                                            "    family = 'robust'\n")
    monkeypatch.setenv(clean.ENV, "odd_plugin")
    assert _plugin_error(clean) == ("plugin 'odd_plugin' (FLOCKFL_PLUGINS): algorithm 'odd': its family is 'robust'; "
                                    "set family to one of global, clustered, personalised (how flockfl list groups it)")


def test_an_entry_point_whose_name_is_not_the_algorithm_s(tmp_path, monkeypatch, clean):
    write_example(tmp_path / "site", MODULE + ".py")
    _install(tmp_path / "site", "misnamed", {}, {"flockfl.algorithms": {"trimmed": f"{MODULE}:TrimmedMean"}})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    msg = _plugin_error(clean)
    assert msg.startswith("plugin 'trimmed' (entry point my_fl_plugins:TrimmedMean in group flockfl.algorithms of "
                          "misnamed): the class's name is 'trimmed_mean'; name the entry point trimmed_mean")


# ---------------------------------------------------------------------- the command line, end to end


@pytest.mark.slow
def test_the_documented_plugin_lists_runs_and_resumes_from_the_command_line(tmp_path):
    """In a folder outside the project: `flockfl list` shows the plugin, `flockfl list NAME` its
    keys; a run of the doc's config killed in round 2 resumes (with the plugin; without it, one
    line) and finishes in MLflow with the method's key logged."""
    folder = write_example(tmp_path / "exp", MODULE + ".py", "trimmed.yaml")
    (folder / "params.yaml").write_text("experiments: {}\npartitions: {}\n")
    env = {"FLOCKFL_PLUGINS": MODULE}
    res = run_flock(["list", "--json"], folder, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    listing = json.loads(res.stdout.strip().splitlines()[-1])
    for kind, name in NAMES.items():
        assert name in listing[kind + "s"], (kind, listing[kind + "s"])
    res = run_flock(["list", "trimmed_mean", "--json"], folder, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert {h["key"]: h["default"] for h in d["hyperparameters"]}["algorithm.trim"] == 0.1
    assert d["origin"] == f"plugin {MODULE!r} (FLOCKFL_PLUGINS)"

    uri = f"sqlite:///{tmp_path}/m.db"
    killed = run_flock(["run", "trimmed.yaml", "--run-dir", "runs/t", "--json", "--tracking-uri", uri,
                        "--set", "tracking.register_model=false"], folder,
                       env={**env, "FLOCKFL_CRASH_AT": "1:aggregate"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert len(list((folder / "runs/t/checkpoints").glob("ckpt-*.pt"))) == 1
    bare = run_flock(["resume", "runs/t", "--json"], folder, timeout=120)
    assert bare.returncode == 2 and "FLOCKFL_PLUGINS" in bare.stderr and "Traceback" not in bare.stderr, bare.stderr
    assert len(bare.stderr.strip().splitlines()) == 1, bare.stderr
    resumed = run_flock(["resume", "runs/t", "--json"], folder, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = last_json(resumed.stdout)
    assert s["algorithm"] == "trimmed_mean" and s["rounds"] == 2 and s["resumed_from_round"] == 1
    assert 0 <= s["metrics"]["accuracy"] <= 1
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(s["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.trim"] == "0.2" and run.data.params["model.name"] == "tiny_cnn"
    assert run.data.params["partition.scheme"] == "quantity_skew"
