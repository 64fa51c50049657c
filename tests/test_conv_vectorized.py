"""The stacked cohort forward (``flockfl.engine.functional.stacked_forward``): convolution
nets trained for a whole cohort without vmap give vmap(grad)'s results bit for bit, and agree
with the per-client reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flockfl.engine import LocalSpec, train_cohort, train_reference, trainers
from flockfl.engine.bn import calibrate_bn_loop
from flockfl.engine.functional import _Pool, conv_layout, stack, stacked_plan
from flockfl.engine.schedule import LrSchedule
from flockfl.engine.runtime import keep_freed_memory
from flockfl.rng import torch_generator
from models import WeightedBatchNorm2d, build_model, init_params

from conftest import rel_err
from test_engine import random_clients

SIZES = [5, 17, 30, 1, 12, 23]


def cohort(model_name: str, shape=(1, 8, 8), sizes=SIZES):
    data = random_clients(sizes, shape=shape)
    model = build_model(model_name, shape, 10, 32)
    init = stack([init_params(model, torch_generator(1, client=i, purpose="init")) for i in range(len(sizes))])
    return data, model, init


def variant(name: str, init: dict, n: int) -> dict:
    """LocalSpec keywords of one training variant (every gradient term, masks, a snapshot, a schedule)."""
    g = torch.Generator().manual_seed(7)
    if name == "epochs":
        return {"epochs": 2, "batch_size": 7}
    if name == "full_batch":
        return {"steps": 3, "full_batch": True}
    if name == "terms":
        return {"epochs": 1, "batch_size": 5, "momentum": 0.9, "weight_decay": 1e-3, "prox_mu": 0.1,
                "prox_anchor": {k: v + 0.05 for k, v in init.items()},
                "correction": {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in init.items()},
                "client_epochs": np.array([1, 2, 1, 3, 2, 1])[:n]}
    if name == "masks":
        return {"epochs": 1, "batch_size": 4, "snapshot_steps": np.full(n, 2),
                "masks": {k: (torch.rand(v.shape, generator=g) > 0.3).float() for k, v in init.items() if k.endswith("weight")}}
    if name == "schedule":
        return {"epochs": 1, "batch_size": 6, "lr_schedule": LrSchedule("inverse", alpha=0.1)}
    raise ValueError(name)


VARIANTS = ["epochs", "full_batch", "terms", "masks", "schedule"]


def plain_arithmetic(model: nn.Module, monkeypatch) -> None:
    """The stacked path as vmap computes it: contiguous NCHW convolutions, BN written out."""
    model.conv_layout = "contiguous"
    monkeypatch.setattr(WeightedBatchNorm2d, "fused", False)


@pytest.mark.parametrize("model_name", ["lenet5", "lenet5_bn", "cnn_bn", "mlp"])
@pytest.mark.parametrize("name", VARIANTS)
def test_stacked_path_equals_vmap_bit_for_bit(model_name, name, monkeypatch):
    """With ``train.conv_layout=contiguous`` and BN written out, the stacked path reproduces
    vmap(grad) exactly (parameters, BN statistics, losses, snapshots): the two differ in dispatch
    only. (The defaults, channels-last and fused BN, agree with both to float rounding.)"""
    data, model, init = cohort(model_name)
    plain_arithmetic(model, monkeypatch)
    spec = LocalSpec(np.arange(len(SIZES)), init, 0.1, **variant(name, init, len(SIZES)))
    a = train_cohort(model, spec, data.train, data.task, seed=4, round=2, method="func")
    b = train_cohort(model, spec, data.train, data.task, seed=4, round=2, method="stacked")
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
    np.testing.assert_array_equal(a.loss, b.loss)
    for k in a.meta.get("snapshot", {}):
        assert torch.equal(a.meta["snapshot"][k], b.meta["snapshot"][k]), k


@pytest.mark.parametrize("model_name", ["lenet5", "cnn_bn"])
def test_stacked_path_on_28x28_equals_vmap_and_reference(model_name, monkeypatch):
    """5×5 valid convolutions (the Fashion-MNIST geometry), a shared FedAvg-style start."""
    data, model, _ = cohort(model_name, (1, 28, 28), [12, 7, 20])
    plain_arithmetic(model, monkeypatch)
    base = init_params(model, torch_generator(2, purpose="init"))
    init = {k: v.unsqueeze(0).expand(3, *v.shape) for k, v in base.items()}
    spec = LocalSpec(np.arange(3), init, 0.05, epochs=1, batch_size=5)
    a = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="func")
    b = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="stacked")
    ref = train_reference(model, spec, data.train, data.task, seed=1, round=0)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert rel_err(b.params, ref.params) < 1e-5
    assert rel_err(ref.params, init) > 1e-3


@pytest.mark.parametrize("model_name", ["lenet5", "lenet5_bn", "cnn_bn"])
@pytest.mark.parametrize("name", ["epochs", "terms", "masks"])
def test_stacked_path_agrees_with_reference(model_name, name, monkeypatch):
    """The defaults (channels-last convolutions, fused BN where a step has no padding, batched
    precise BN) against the reference loop with BN written out and a per-client precise BN."""
    data, model, init = cohort(model_name)
    spec = LocalSpec(np.arange(len(SIZES)), init, 0.1, **variant(name, init, len(SIZES)))
    with monkeypatch.context() as m:
        m.setattr(WeightedBatchNorm2d, "fused", False)
        m.setattr(trainers, "calibrate_bn", calibrate_bn_loop)
        ref = train_reference(model, spec, data.train, data.task, seed=4, round=2)
    vec = train_cohort(model, spec, data.train, data.task, seed=4, round=2)  # auto: the stacked path
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_array_equal(vec.num_steps, ref.num_steps)
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)


@pytest.mark.parametrize("relu", [True, False])
def test_channels_last_pool_is_exact_with_ties(relu):
    """ReLU after the pooling instead of before, in the channels-last layout: the same values and
    the same gradient, also where windows tie (quantised inputs, all-negative windows)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (4, 6, 8, 8), generator=g).float()
    up = torch.randn(4, 6, 4, 4, generator=g)
    a = x.clone().requires_grad_()
    want = nn.functional.max_pool2d(torch.relu(a) if relu else a, 2)
    (want_g,) = torch.autograd.grad(want, a, up)
    b = x.clone().requires_grad_()
    got = _Pool.apply(b, {"kernel_size": 2}, relu)
    (got_g,) = torch.autograd.grad(got, b, up)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(got_g, want_g) and got_g.is_contiguous()


def test_unknown_layers_fall_back_to_vmap():
    """A layer the stacked forward does not know (here Tanh) leaves the model to vmap; asking
    for the stacked path by name is refused."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(144, 10))
    assert stacked_plan(model) is None
    assert stacked_plan(build_model("lenet5", (1, 8, 8), 10)) is not None
    data = random_clients([6, 9], shape=(1, 8, 8))
    init = stack([{k: v.detach().clone() for k, v in model.named_parameters()}] * 2)
    spec = LocalSpec(np.arange(2), init, 0.1, epochs=1, batch_size=4)
    ref = train_reference(model, spec, data.train, data.task, seed=0, round=0)
    assert rel_err(train_cohort(model, spec, data.train, data.task, seed=0, round=0).params, ref.params) < 1e-5
    with pytest.raises(ValueError, match="stacked"):
        train_cohort(model, spec, data.train, data.task, seed=0, round=0, method="stacked")


def test_allocator_setting_can_be_left_alone(monkeypatch):
    monkeypatch.setenv("FLOCKFL_MALLOC", "system")
    assert keep_freed_memory() is False


@pytest.mark.parametrize("model_name", ["lenet5", "cnn_bn"])
def test_conv_layout_is_channels_last_on_cpu_by_default_and_agrees(model_name, monkeypatch):
    """``train.conv_layout``: ``auto`` (a model's default) runs the grouped convolutions
    channels-last on a CPU, ``contiguous`` in NCHW (vmap's bits); both agree with the reference
    loop to float rounding."""
    seen: list = []
    conv2d = nn.functional.conv2d
    monkeypatch.setattr(nn.functional, "conv2d", lambda a, *args: (a.shape[1] > 1 and seen.append(  # 1 channel: both
        a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous()), conv2d(a, *args))[1])
    data, model, init = cohort(model_name, (1, 28, 28), [12, 7, 20])
    spec = LocalSpec(np.arange(3), init, 0.05, epochs=1, batch_size=5, momentum=0.5)
    ref = train_reference(model, spec, data.train, data.task, seed=1, round=0)
    seen.clear()
    assert conv_layout(model) == "auto"
    cl = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="stacked")
    assert seen and all(seen)
    model.conv_layout = "contiguous"
    seen.clear()
    nchw = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="stacked")
    assert seen and not any(seen)
    for got in (cl, nchw):
        assert all(v.is_contiguous() for v in got.params.values())
        assert rel_err(got.params, ref.params) < 1e-5
        assert rel_err(got.params, init) > 1e-3
        np.testing.assert_allclose(got.loss, ref.loss, rtol=1e-4)


def test_conv_layout_key_reaches_the_run_model(tmp_path):
    """``train.conv_layout`` is set on the run's model (also a worker's, which prepares its
    own); a wrong word is a one-line ConfigError."""
    from conftest import tiny_config
    from flockfl.errors import ConfigError
    from flockfl.experiments import validate
    from flockfl.rounds import prepare

    model = {"model": {"name": "lenet5"}}
    assert conv_layout(prepare(validate(tiny_config(**model)), tmp_path).ctx.model) == "auto"
    cfg = validate(tiny_config(**model, train={"conv_layout": "contiguous"}))
    assert conv_layout(prepare(cfg, tmp_path).ctx.model) == "contiguous"
    with pytest.raises(ConfigError, match="train.conv_layout"):
        validate(tiny_config(train={"conv_layout": "nhwc"}))
