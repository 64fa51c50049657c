"""The local optimiser's weight decay and learning-rate schedules (``train.weight_decay``,
``train.lr_schedule``): both trainers agree with each other and with a hand-written
``torch.optim.SGD`` loop, they compose with momentum and pruning masks, a resumed run stays
bit-identical, and every bad value is one line with exit code 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flockfl.client import pass_spec, round_spec
from flockfl.engine import LocalSpec, train_cohort, train_reference
from flockfl.engine.data import Split
from flockfl.engine.functional import stack
from flockfl.engine.schedule import LrSchedule, client_batches
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rng import np_rng, torch_generator
from models import build_model, init_params

from conftest import assert_resume_bit_identical, assert_trainers_agree, rel_err, tiny_config

INVERSE = LrSchedule("inverse", alpha=0.05, b=0.75)  # a visible decay over a few steps (the thesis: α = 0.001)
STEP = LrSchedule("step", gamma=0.5, every=2)


def clients_data(sizes, shape=(1, 8, 8), classes=10, seed=0) -> Split:
    g = torch.Generator().manual_seed(seed)
    n = int(sum(sizes))
    return Split(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g),
                 np.cumsum([0] + list(sizes)).astype(np.int64))


def stacked_init(model, n: int, seed: int = 5) -> dict[str, torch.Tensor]:
    return stack([init_params(model, torch_generator(seed, client=i, purpose="init")) for i in range(n)])


# ---------------------------------------------------------------------- the schedules


def test_rates_follow_the_formulas():
    assert LrSchedule().rates(0.1, 7, 3) == [0.1] * 3
    # η₀(1 + α·i)^−b, i counted from 0 within the pass, whatever the round
    inv = LrSchedule("inverse", alpha=0.5, b=1.0)
    assert inv.rates(0.1, 0, 3) == pytest.approx([0.1, 0.1 / 1.5, 0.1 / 2.0], abs=1e-15)
    assert inv.rates(0.1, 9, 3) == inv.rates(0.1, 0, 3)  # reset every round (thesis §2.8)
    thesis = LrSchedule("inverse")  # η₀ = 0.001, α = 0.001, b = 0.75 over 500 local steps
    assert thesis.rates(0.001, 0, 500)[-1] == pytest.approx(0.001 * (1 + 0.001 * 499) ** -0.75)
    # η₀·γ^⌊r/every⌋, constant within the round; a pass before round 0 counts as round 0
    assert STEP.rates(0.1, 0, 2) == STEP.rates(0.1, 1, 2) == STEP.rates(0.1, -1, 2) == [0.1, 0.1]
    assert STEP.rates(0.1, 5, 1) == [pytest.approx(0.1 * 0.25)]


def test_specs_built_from_train_carry_the_optimiser():
    cfg = validate(tiny_config(train={"weight_decay": 5e-4, "lr_schedule": "inverse", "lr_alpha": 0.01, "lr_b": 0.5}))
    init = {"w": torch.zeros(2, 3)}
    for spec in (round_spec(cfg.train, np.arange(2), init), pass_spec(cfg.train, np.arange(2), init, 1, stream="x")):
        assert spec.weight_decay == 5e-4
        assert spec.lr_schedule == LrSchedule("inverse", 0.01, 0.5, 0.99, 1)
        assert spec.has_extras  # weight decay is a gradient term: never the plain dense step
    plain = round_spec(validate(tiny_config()).train, np.arange(2), init)
    assert plain.weight_decay == 0 and plain.lr_schedule == LrSchedule() and not plain.has_extras


# ---------------------------------------------------------------------- the two trainers


CASES = {
    "weight_decay": {"weight_decay": 0.05},
    "inverse": {"lr_schedule": INVERSE},
    "step": {"lr_schedule": STEP},
    "all": {"weight_decay": 0.05, "lr_schedule": INVERSE, "momentum": 0.9, "prox_mu": 0.3},
}


@pytest.mark.parametrize("model_name", ["mlp", "lenet5"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_trainers_agree(model_name, case):
    """Unequal client sizes and step counts; round 5 so that ``step`` has decayed twice (the
    vectorised MLP then takes the dense path at the round's rate)."""
    data = clients_data([9, 17, 30, 12, 23])
    model = build_model(model_name, (1, 8, 8), 10, 16)
    init = stacked_init(model, 5)
    spec = LocalSpec(np.arange(5), init, 0.1, batch_size=4, client_steps=np.array([1, 3, 6, 0, 4]), **CASES[case])
    ref = train_reference(model, spec, data, "classification", seed=0, round=5)
    vec = train_cohort(model, spec, data, "classification", seed=0, round=5)
    np.testing.assert_array_equal(vec.num_steps, [1, 3, 6, 0, 4])
    for k in init:
        torch.testing.assert_close(vec.params[k], ref.params[k], rtol=0, atol=1e-6)
    # the option acted: the same spec without it ends elsewhere
    off = {"weight_decay": 0.0, "lr_schedule": LrSchedule()}
    base = train_reference(model, LocalSpec(**{**spec.__dict__, **off}), data, "classification", seed=0, round=5)
    assert rel_err(ref.params, base.params) > 1e-4


@pytest.mark.parametrize("schedule", [LrSchedule(), INVERSE, STEP])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 1e-2), (0.9, 1e-2), (0.5, 0.0)])
def test_one_client_matches_torch_sgd(schedule, momentum, weight_decay):
    """Both trainers against torch.optim.SGD(lr, momentum, weight_decay) stepped by hand over the
    same batches, its rate set before every step."""
    data = clients_data([37])
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stacked_init(model, 1)
    round_ = 3
    spec = LocalSpec(np.arange(1), init, 0.08, epochs=2, batch_size=5, momentum=momentum, weight_decay=weight_decay,
                     lr_schedule=schedule)
    batches = client_batches(37, spec, np_rng(11, round_, 0, "shuffle"))
    net = build_model("mlp", (1, 8, 8), 10, 16)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(init[name][0])
    opt = torch.optim.SGD(net.parameters(), lr=0.08, momentum=momentum, weight_decay=weight_decay)
    for i, b in enumerate(batches):
        if schedule.kind == "inverse":
            rate = 0.08 * (1 + schedule.alpha * i) ** -schedule.b
        elif schedule.kind == "step":
            rate = 0.08 * schedule.gamma ** (round_ // schedule.every)
        else:
            rate = 0.08
        for group in opt.param_groups:
            group["lr"] = rate
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(data.x[b]), data.y[b]).backward()
        opt.step()
    for trainer in (train_reference, train_cohort):
        res = trainer(model, spec, data, "classification", 11, round_)
        for name, p in net.named_parameters():
            torch.testing.assert_close(res.params[name][0], p.detach(), rtol=0, atol=1e-6)


def test_masks_compose_with_weight_decay_momentum_and_a_schedule():
    """A pruned weight (0 in the init, mask 0) stays exactly 0 under weight decay and momentum;
    the kept ones train; both trainers agree."""
    data = clients_data([20, 31, 14])
    model = build_model("lenet5_bn", (1, 8, 8), 10)
    init = stacked_init(model, 3)
    g = torch.Generator().manual_seed(0)
    masks = {k: (torch.rand(v.shape, generator=g) > 0.5).float() for k, v in init.items() if k.endswith("weight") and v.dim() > 2}
    init = {k: v * masks[k] if k in masks else v for k, v in init.items()}
    spec = LocalSpec(np.arange(3), init, 0.05, epochs=2, batch_size=6, momentum=0.9, weight_decay=0.01,
                     lr_schedule=INVERSE, masks=masks)
    ref = train_reference(model, spec, data, "classification", seed=2, round=1)
    vec = train_cohort(model, spec, data, "classification", seed=2, round=1)
    assert rel_err(vec.params, ref.params) < 1e-5
    for k, m in masks.items():
        assert torch.all(ref.params[k][m == 0] == 0) and torch.all(vec.params[k][m == 0] == 0)
        assert torch.all(ref.params[k][m == 1] != init[k][m == 1])


# ---------------------------------------------------------------------- whole runs


OPTIMISED = {"train": {"weight_decay": 1e-3, "momentum": 0.5, "lr_schedule": "inverse", "lr_alpha": 0.05}}


@pytest.mark.parametrize("over", [
    {**OPTIMISED, "algorithm": {"name": "fedprox"}},
    {"train": {"weight_decay": 1e-3, "lr_schedule": "step", "lr_gamma": 0.5}, "algorithm": {"name": "fedavg"}},
], ids=["fedprox_inverse", "fedavg_step"])
def test_runs_agree_across_trainers(over, tmp_path):
    from flockfl.config import deep_merge

    assert_trainers_agree(lambda e: validate(tiny_config(**deep_merge(over, {"train": {"engine": e}}))), tmp_path, tol=1e-5)


@pytest.mark.parametrize("schedule", [{"lr_schedule": "inverse", "lr_alpha": 0.05}, {"lr_schedule": "step", "lr_gamma": 0.5}])
def test_resume_is_bit_identical_with_a_schedule(schedule, tmp_path):
    cfg = validate(tiny_config(train={"rounds": 4, "weight_decay": 1e-3, "momentum": 0.5, **schedule}))
    assert_resume_bit_identical(cfg, tmp_path, until=2)


# ---------------------------------------------------------------------- bad values


BAD = [
    ({"train": {"weight_decay": -1e-4}}, "train.weight_decay"),
    ({"train": {"lr_schedule": "cosine"}}, "train.lr_schedule"),
    ({"train": {"lr_alpha": -0.1}}, "train.lr_alpha"),
    ({"train": {"lr_b": -1}}, "train.lr_b"),
    ({"train": {"lr_gamma": 0}}, "train.lr_gamma"),
    ({"train": {"lr_gamma": 1.5}}, "train.lr_gamma"),
    ({"train": {"lr_step_rounds": 0}}, "train.lr_step_rounds"),
    ({"train": {"weight_decay": 1e-4}, "algorithm": {"name": "pfedme"}}, "train.weight_decay"),  # its L2 is inner_l2
    ({"train": {"momentum": 0.5}, "algorithm": {"name": "pfedme"}}, "train.momentum"),
    ({"train": {"lr_schedule": "step"}, "algorithm": {"name": "ifca", "option": "gradient"}}, "train.lr_schedule"),
    ({"train": {"lr_schedule": "inverse"}, "algorithm": {"name": "scaffold"}}, "train.lr_schedule"),
    ({"train": {"lr_schedule": "step"}, "algorithm": {"name": "fednova"}}, "train.lr_schedule"),
]


@pytest.mark.parametrize("over,key", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_one_line(over, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    msg = str(err.value)
    assert msg.startswith(f"config error: {key}") and "\n" not in msg


def test_schedules_are_allowed_where_they_act():
    validate(tiny_config(train={"lr_schedule": "inverse", "weight_decay": 1e-5}, algorithm={"name": "scaffold", "option": "I"}))
    for name in ("apfl", "perfedavg"):  # their own loops take all three (tests/test_personal_rules.py)
        validate(tiny_config(train={"lr_schedule": "inverse", "weight_decay": 1e-5, "momentum": 0.5}, algorithm={"name": name}))
    validate(tiny_config(train={"lr_schedule": "inverse"}, algorithm={"name": "pfedme"}))
    validate(tiny_config(train={"weight_decay": 1e-5}, algorithm={"name": "fednova"}))  # NIID-Bench's FedNova setting


def test_cli_exits_2_with_one_line(workdir, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(workdir)
    assert main(["run", "fedavg_rotated_digits", "--set", "train.lr_schedule=cosine"]) == 2
    err = capsys.readouterr().err
    assert "train.lr_schedule" in err and err.count("\n") == 1 and "Traceback" not in err
