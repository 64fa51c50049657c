"""BatchNorm's fast paths against the written-out reference (``flockfl.engine.bn``): the fused
kernel in steps without padding (the module's and the stacked path's), and precise BN for a
whole cohort in one pass against the per-client loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flockfl.engine import LocalSpec, bn, train_cohort, train_reference, trainers
from flockfl.engine.bn import calibrate_bn, calibrate_bn_loop
from flockfl.engine.functional import stack
from flockfl.engine.schedule import cohort_schedule, stack_schedule
from flockfl.rng import torch_generator
from models import WeightedBatchNorm2d, build_model, init_params

from conftest import rel_err
from test_engine import random_clients


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of ``F.batch_norm`` (the fused kernel)."""
    calls = []
    batch_norm = nn.functional.batch_norm
    monkeypatch.setattr(nn.functional, "batch_norm", lambda *a, **k: (calls.append(a[0].shape), batch_norm(*a, **k))[1])
    return calls


def test_module_fused_equals_written_out_forward_and_backward(monkeypatch, fused_calls):
    """``WeightedBatchNorm2d`` in training mode without sample weights: ``F.batch_norm`` gives
    the written-out statistics' output and gradients to float rounding."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(16, 5, 6, 6, generator=g) + 1).requires_grad_()
    up = torch.randn(16, 5, 6, 6, generator=g)
    m = WeightedBatchNorm2d(5).train()
    with torch.no_grad():
        m.weight.copy_(torch.rand(5, generator=g) + 0.5)
        m.bias.copy_(torch.randn(5, generator=g))
    out = {}
    for fused in (False, True):
        monkeypatch.setattr(WeightedBatchNorm2d, "fused", fused)
        y = m(x)
        out[fused] = (y, *torch.autograd.grad(y, [x, m.weight, m.bias], up))
    assert len(fused_calls) == 1  # the fused run only
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(out[True][0].detach().std()) > 0.5  # normalised, not zeros
    # with sample weights (a vectorised batch) or a record (precise BN): written out
    m(x, sample_weight=torch.full((16,), 1 / 16))
    m(x, record=[])
    assert len(fused_calls) == 1


@pytest.mark.parametrize("model_name", ["lenet5_bn", "cnn_bn"])
@pytest.mark.parametrize("sizes,padded", [([20, 20, 20], False), ([20, 13, 7], True)])
def test_stacked_bn_fused_only_without_padding_and_agrees(model_name, sizes, padded, monkeypatch, fused_calls):
    """The stacked path runs ``F.batch_norm`` in the steps where every slot is real (equal
    clients, a batch that divides them) and the weighted statistics where a slot is padded;
    either way it agrees with the reference loop whose BN is written out."""
    data = random_clients(sizes, shape=(1, 8, 8))
    model = build_model(model_name, (1, 8, 8), 10)
    init = stack([init_params(model, torch_generator(3, client=i, purpose="init")) for i in range(len(sizes))])
    spec = LocalSpec(np.arange(len(sizes)), init, 0.1, epochs=2, batch_size=5, momentum=0.5)
    with monkeypatch.context() as m:
        m.setattr(WeightedBatchNorm2d, "fused", False)
        m.setattr(trainers, "calibrate_bn", calibrate_bn_loop)
        ref = train_reference(model, spec, data.train, data.task, seed=2, round=1)
    assert not fused_calls
    vec = train_cohort(model, spec, data.train, data.task, seed=2, round=1, method="stacked")
    sched = stack_schedule(cohort_schedule(spec, data.train.sizes, 2, 1), data.train.offsets, spec.clients)
    full_steps = int((sched.weight > 0).flatten(1).all(1).sum())  # steps in which every client fills the batch
    assert full_steps > 0 and (full_steps < sched.steps) == padded
    assert len(fused_calls) == 2 * full_steps  # two BN layers a step
    assert rel_err(vec.params, ref.params) < 1e-5
    assert rel_err(vec.params, init) > 1e-3
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)


def test_reference_trainer_fused_agrees_with_written_out(monkeypatch, fused_calls):
    data = random_clients([9, 14], shape=(1, 8, 8))
    model = build_model("cnn_bn", (1, 8, 8), 10)
    init = stack([init_params(model, torch_generator(5, client=i, purpose="init")) for i in range(2)])
    spec = LocalSpec(np.arange(2), init, 0.1, epochs=2, batch_size=4)
    fast = train_reference(model, spec, data.train, data.task, seed=0, round=0)
    assert fused_calls  # the reference loop's BN ran fused
    monkeypatch.setattr(WeightedBatchNorm2d, "fused", False)
    plain = train_reference(model, spec, data.train, data.task, seed=0, round=0)
    assert rel_err(fast.params, plain.params) < 1e-5
    assert rel_err(fast.params, init) > 1e-3


def trained_cohort(model_name: str, sizes, shape=(1, 8, 8)):
    """Stacked parameters of len(sizes) different models, their BN statistics still the init's."""
    data = random_clients(sizes, shape=shape, seed=1)
    model = build_model(model_name, shape, 10)
    g = torch.Generator().manual_seed(4)
    params = stack([init_params(model, torch_generator(6, client=i, purpose="init")) for i in range(len(sizes))])
    params = {k: v + 0.2 * torch.randn(v.shape, generator=g) if not k.endswith(("running_mean", "running_var")) else v
              for k, v in params.items()}
    return data, model, params


@pytest.mark.parametrize("model_name", ["lenet5_bn", "cnn_bn"])
@pytest.mark.parametrize("layout", ["auto", "contiguous"])
@pytest.mark.parametrize("rows", [1, 40, 4096])  # a group per client, groups of two, a group per size
def test_batched_precise_bn_equals_per_client_loop(model_name, layout, rows, monkeypatch):
    """Every client's statistics from one stacked pass per group of equal-size clients equal
    the per-client loop's to float rounding: clients of unequal size, one of a single sample
    (variance 0, the count-1 correction guarded) and one without samples (left as it was)."""
    sizes = [12, 0, 30, 1, 17, 17, 5, 17, 12]
    data, model, params = trained_cohort(model_name, sizes, (1, 28, 28) if model_name == "cnn_bn" else (1, 8, 8))
    model.conv_layout = layout
    monkeypatch.setattr(bn, "CALIBRATE_ROWS", rows)
    clients = np.array([4, 1, 0, 2, 6, 3, 5, 7, 8])  # not in order: row i is clients[i]
    want = {k: v.clone() for k, v in params.items()}
    calibrate_bn_loop(model, want, data.train, clients)
    got = {k: v.clone() for k, v in params.items()}
    calibrate_bn(model, got, data.train, clients)
    stats = [k for k in params if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 4
    for k in stats:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[k][1], params[k][1])  # the empty client is left alone
        assert not torch.equal(want[k][0], params[k][0])  # the statistics did change
    for k in params:
        if k not in stats:
            assert torch.equal(got[k], params[k])


def test_precise_bn_falls_back_to_the_loop_without_a_stacked_plan(monkeypatch):
    """A model the stacked forward does not know is calibrated client by client."""
    data, model, params = trained_cohort("cnn_bn", [6, 9])
    called = []
    monkeypatch.setattr(bn, "calibrate_bn_loop", lambda *a: called.append(1))
    monkeypatch.setattr(bn, "stacked_plan", lambda model: None)
    calibrate_bn(model, params, data.train, np.arange(2))
    assert called

