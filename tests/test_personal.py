"""Partial-sharing personalised baselines: FedPer, LG-FedAvg, FedRep, FedBABU, FedBN
(flockfl/algorithms/personal.py and one module each)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_resume_bit_identical, last_json, tiny_config


def cfg_of(name: str, model: str = "mlp", engine: str = "vectorized", **over):
    from flockfl.experiments import validate

    algo = {"name": name, **over.pop("algorithm", {})}
    train = {"engine": engine, **over.pop("train", {})}
    return validate(tiny_config(algorithm=algo, model={"name": model, "hidden": 16}, train=train, **over))


def run(cfg, tmp_path, until=None):
    from flockfl.rounds import prepare, run_rounds

    prep = prepare(cfg, tmp_path)
    return prep, run_rounds(prep, until=until)


def test_partitions_cover_the_model_by_module_type():
    from flockfl.algorithms.partial import resolve_layers
    from models import build_model

    m = build_model("lenet5_bn", (1, 8, 8), 10)
    names = [n for n, _ in m.named_parameters()]
    assert resolve_layers(m, "head") == ["fc3.weight", "fc3.bias"]
    assert resolve_layers(m, "bn") == [n for n in names if n.startswith(("bn1.", "bn2."))]
    assert "bn1.running_var" in resolve_layers(m, "bn")  # statistics stay local too
    assert resolve_layers(m, "top:2") == ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert resolve_layers(m, "bottom:1") == ["conv1.weight", "conv1.bias"]
    assert resolve_layers(m, "none") == [] and resolve_layers(m, "all") == names
    assert resolve_layers(m, "fc1.,bn2.") == [n for n in names if n.startswith(("bn2.", "fc1."))]
    assert resolve_layers(build_model("mlp", (1, 8, 8), 10, 16), "bn") == []


DEGENERATE = [
    ("fedper", {"personal_layers": "none"}, "algorithm.personal_layers=none leaves no trained layer personal"),
    ("lg_fedavg", {"global_layers": "all"}, "algorithm.global_layers=all leaves no trained layer personal"),
    ("lg_fedavg", {}, "algorithm.global_layers=top:2 leaves no trained layer personal on model mlp"),  # LG's default
    ("fedrep", {"personal_layers": "none", "head_epochs": 0, "body_epochs": 1}, "fedrep would be FedAvg"),
    ("fedbabu", {"personal_layers": "none", "weighting": "samples", "finetune_epochs": 0}, "fedbabu would be FedAvg"),
    ("fedbn", {"weighting": "samples"}, "use a model with BatchNorm layers"),  # mlp: no BN
]


@pytest.mark.parametrize("name,over,needle", DEGENERATE, ids=[f"{d[0]}-{i}" for i, d in enumerate(DEGENERATE)])
def test_a_split_with_nothing_personal_refuses_in_one_line(name, over, needle):
    """No silent degeneration: a split that leaves nothing personal runs FedAvg under another
    method's name, so it is refused, naming the key to change."""
    from flockfl.errors import ConfigError

    with pytest.raises(ConfigError, match=needle) as err:
        cfg_of(name, algorithm=over)
    assert "\n" not in str(err.value) and "would be FedAvg" in str(err.value)


@pytest.mark.parametrize("name,over", [(n, o) for n, o, _ in DEGENERATE if o or n == "fedbn"],
                         ids=[n for n, o, _ in DEGENERATE if o or n == "fedbn"])
def test_no_personal_layers_is_fedavg(name, over, tmp_path, monkeypatch):
    """The sanity limit behind the refusal: with the check lifted, the maths is FedAvg's bit for bit."""
    from flockfl.algorithms import ALGORITHMS

    _, ref = run(cfg_of("fedavg", train={"eval_finetune": "off"}), tmp_path / "a")
    monkeypatch.setattr(ALGORITHMS[name], "check_config", classmethod(lambda cls, cfg: None))
    _, got = run(cfg_of(name, algorithm=over, train={"eval_finetune": "off"}), tmp_path / "b")
    for k in ref.models:
        assert torch.equal(ref.models[k], got.models[k]), k
    assert got.history[-1]["bytes_up"] == ref.history[-1]["bytes_up"]


def test_lg_without_global_layers_refuses_as_local_training(tmp_path, monkeypatch):
    from flockfl.algorithms import ALGORITHMS
    from flockfl.errors import ConfigError

    with pytest.raises(ConfigError, match="makes every trained layer of model mlp personal: lg_fedavg would be local "
                                          r"training \(algorithm.name=local\); set algorithm.global_layers"):
        cfg_of("lg_fedavg", algorithm={"global_layers": "none"})
    monkeypatch.setattr(ALGORITHMS["lg_fedavg"], "check_config", classmethod(lambda cls, cfg: None))
    _, st = run(cfg_of("lg_fedavg", algorithm={"global_layers": "none"}, train={"rounds": 1, "eval_finetune": "off"}),
                tmp_path)
    assert st.history[-1]["bytes_total"] == 0


def test_one_cluster_runs_and_says_it_is_fedavg(capsys):
    """k = 1 is a legitimate limit of the clustered methods (a sanity check): it runs, and the
    note reaches the user (stderr at load, the summary's ``notes``, the MLflow tag)."""
    from flockfl.algorithms import ALGORITHMS
    from flockfl.experiments import validate

    for name in ("ifca", "ifca_oneshot", "flexcfl", "fesem", "fedsc", "fedcluster"):
        cfg = validate(tiny_config(algorithm={"name": name, "k": 1}))
        assert ALGORITHMS[name].notes(cfg) == [f"algorithm.k=1: one cluster, so {name} runs as FedAvg "
                                                "(set algorithm.k >= 2 to cluster)"]
        assert ALGORITHMS[name].notes(validate(tiny_config(algorithm={"name": name, "k": 2}))) == []
    assert ALGORITHMS["fedac"].notes(validate(tiny_config(algorithm={"name": "fedac", "k": 1}))) == []  # k grows


@pytest.mark.parametrize("name,model,over", [
    ("fedrep", "mlp", {"head_epochs": 1}),
    ("fedbn", "cnn_bn", {}),
])
def test_trainers_agree(name, model, over, tmp_path):
    states = [run(cfg_of(name, model, engine=e, algorithm=over,
                         train={"rounds": 1, "clients_per_round": 3, "eval_finetune": "off"}),
                  tmp_path / e)[1] for e in ("reference", "vectorized")]
    a, b = states
    for k in a.models:
        torch.testing.assert_close(b.models[k], a.models[k], rtol=1e-5, atol=1e-6)
    ta, tb = a.algo["personal"].dense(), b.algo["personal"].dense()
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-5, atol=1e-6)


def test_resume_is_bit_identical(tmp_path):
    assert_resume_bit_identical(cfg_of("fedrep", algorithm={"head_epochs": 1}), tmp_path)


def test_only_the_cohort_rows_are_written_and_heads_never_travel(tmp_path):
    prep, st = run(cfg_of("fedper", train={"rounds": 1, "eval_finetune": "off"}), tmp_path)
    cohort = prep.algorithm.select(prep.algorithm.init_state(prep.ctx), prep.ctx, 0)
    np.testing.assert_array_equal(np.flatnonzero(st.algo["personal"].written()), cohort)
    init = prep.algorithm.init_state(prep.ctx).models
    for k in ("3.weight", "3.bias"):  # the head: the init in the server model, trained in the rows
        assert torch.equal(st.models[k], init[k])
        assert not torch.equal(st.algo["personal"].gather(cohort[:1])[k][0], init[k][0])
    body = sum(v[0].numel() * 4 for k, v in init.items() if not k.startswith("3."))
    assert st.history[-1]["bytes_up"] == len(cohort) * body


def test_fedbabu_head_stays_at_init_and_zero_finetune_is_global(tmp_path):
    prep, st = run(cfg_of("fedbabu", algorithm={"finetune_epochs": 0}, train={"rounds": 2, "momentum": 0.9}), tmp_path)
    init = prep.algorithm.init_state(prep.ctx).models
    assert torch.equal(st.models["3.weight"], init["3.weight"]) and torch.equal(st.models["3.bias"], init["3.bias"])
    assert not torch.equal(st.models["1.weight"], init["1.weight"])
    h = st.history[-1]
    assert h["accuracy"] == h["accuracy_global"] == h["accuracy_personal"]


def test_fedrep_phases_freeze_the_other_part(tmp_path):
    from flockfl.rounds import prepare

    prep = prepare(cfg_of("fedrep", algorithm={"head_epochs": 1}), tmp_path)
    alg, ctx = prep.algorithm, prep.ctx
    state = alg.init_state(ctx)
    clients = np.array([0, 1])
    spec = alg.local_spec(state, ctx, clients, 0)
    for k in ("1.weight", "1.bias"):  # head epochs: the body is untouched
        assert torch.equal(spec.init[k], state.models[k].expand_as(spec.init[k]))
    assert not torch.equal(spec.init["3.weight"][0], state.models["3.weight"][0])
    assert spec.epochs == 1 and all(float(m.abs().sum()) == 0 for m in spec.masks.values())
    assert sorted(spec.masks) == ["3.bias", "3.weight"]  # body epochs: the head is frozen


def test_personal_beats_fedavg_on_label_skew(tmp_path):
    """Shards (2 labels per client), 20 clients: each client's personal model beats the global FedAvg model."""
    common = {"partition": {"scheme": "shards", "num_clients": 20},
              "train": {"rounds": 5, "clients_per_round": 10, "eval_finetune": "off"}}
    acc = {}
    for name, over in [("fedavg", {}), ("fedper", {}), ("lg_fedavg", {"global_layers": "top:1"}),
                       ("fedrep", {"head_epochs": 1}), ("fedbabu", {"finetune_epochs": 2, "finetune_lr": 0.05})]:
        _, st = run(cfg_of(name, algorithm=over, **common), tmp_path / name)
        acc[name] = st.history[-1]["accuracy"]
    print(acc)
    for name in ("fedper", "lg_fedavg", "fedrep", "fedbabu"):
        assert acc[name] > acc["fedavg"] + 0.2, acc


@pytest.mark.parametrize("name,key,bad", [
    ("fedper", "personal_layers", "fc9."), ("fedper", "personal_layers", "top:9"), ("fedper", "personal_layers", 3),
    ("lg_fedavg", "global_layers", "middle"), ("fedrep", "head_epochs", -1), ("fedrep", "body_epochs", 1.5),
    ("fedrep", "personal_layers", ""), ("fedbabu", "finetune_epochs", -1), ("fedbabu", "finetune_lr", 0),
    ("fedbabu", "finetune_momentum", 1.0), ("fedbabu", "finetune_parts", "body"), ("fedbabu", "personal_layers", "x,"),
    ("fedbn", "weighting", "median"),
])
def test_bad_values_are_one_line_config_errors(name, key, bad):
    from flockfl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        cfg_of(name, algorithm={key: bad})
    msg = str(err.value)
    assert "\n" not in msg and f"algorithm.{key}" in msg


def test_cli_lists_fedrep(capsys):
    from flows.cli import main

    assert main(["list", "fedrep", "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    text = json.dumps(out)
    assert "Collins" in text and "algorithm.head_epochs" in text and "algorithm.body_epochs" in text
