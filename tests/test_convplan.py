"""The reordered CNN evaluation pass (flockfl.engine.convplan) gives the model's own outputs bit
for bit: conv → pool → ReLU for conv → ReLU → pool, and BatchNorm's affine map after the pool
with negative-scale channels' filters negated; models it does not know run as they are. With
the one-channel conv + pool kernel (flockfl.engine.convkernel) the outputs agree to float
rounding and the kernel's own results match ``max_pool2d(conv2d(...))`` on every shape it takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from flockfl.engine import convkernel, convplan
from flockfl.engine.evaluate import outputs
from models import build_model


def random_params(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Parameters with BN scales of both signs and statistics far from their initial values."""
    g = torch.Generator().manual_seed(seed)
    p = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in model.named_parameters()}
    for k in p:
        if k.endswith("running_var"):
            p[k] = p[k].abs() + 0.1
    return p


@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8), (3, 32, 32)])
@pytest.mark.parametrize("name", ["lenet5", "lenet5_padded", "lenet5_bn", "cnn_bn", "pfllib_cnn", "pfl_cnn"])
def test_the_plan_gives_the_models_outputs_bit_for_bit(name, shape, monkeypatch):
    monkeypatch.setenv(convkernel.ENV, "off")  # the reordering alone is exact; the kernel is not
    model = build_model(name, shape, 10).eval()
    steps = convplan.plan(model)
    assert steps is not None, f"{name} should have a plan"
    p = random_params(model, 0)
    bns = [k for k in p if k.endswith(".weight") and k.startswith("bn")]
    if bns:  # both signs of the BN scale are exercised
        assert any((p[k] < 0).any() for k in bns) and any((p[k] > 0).any() for k in bns)
    x = torch.randn(37, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(convplan.run(steps, p, x), functional_call(model, p, (x,)))
        fast = outputs(model, p, x)  # the evaluation pass takes the plan, in its row chunks
        monkeypatch.setattr(convplan, "plan", lambda m: None)
        assert torch.equal(fast, outputs(model, p, x))  # the model's own forward, the same chunks


def test_the_two_step_maximum_is_max_pool2d():
    x = torch.randn(5, 3, 13, 11)
    for k in ((2, 2), (3, 3), (2, 3)):
        assert torch.equal(convplan.max2d(x, k), nn.functional.max_pool2d(x, k))


def test_models_it_does_not_know_run_as_they_are():
    overlapping = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(3, stride=2), nn.Flatten(), nn.Linear(4 * 12 * 12, 10))
    other = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    assert convplan.plan(overlapping) is None and convplan.plan(other) is None
    assert convplan.plan(build_model("mlp", (1, 8, 8), 10)) is None
    x = torch.randn(4, 1, 28, 28)
    p = dict(overlapping.named_parameters())
    with torch.no_grad():
        assert torch.equal(outputs(overlapping, p, x), overlapping(x))


needs_kernel = pytest.mark.skipif(not convkernel.available(), reason="no C compiler: the conv kernel is not built")


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8)])
@pytest.mark.parametrize("name", ["lenet5", "lenet5_padded", "lenet5_bn", "cnn_bn"])
def test_the_plan_with_the_conv_kernel_gives_the_models_outputs_to_rounding(name, shape, monkeypatch):
    model = build_model(name, shape, 10).eval()
    p = random_params(model, 0)
    x = torch.randn(37, *shape, generator=torch.Generator().manual_seed(1))
    calls = []
    real = convkernel.conv_pool
    monkeypatch.setattr(convkernel, "conv_pool", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fast, own = outputs(model, p, x), functional_call(model, p, (x,))
    assert calls, "the first convolution should run in the kernel"
    torch.testing.assert_close(fast, own, rtol=1e-4, atol=1e-4 * float(own.abs().max()))
    assert (fast.argmax(1) == own.argmax(1)).float().mean() > 0.97


def _reference(x, w, b, padding):
    return nn.functional.max_pool2d(nn.functional.conv2d(x, w, b, padding=padding), 2)


@needs_kernel
@pytest.mark.parametrize("c", [1, 4, 6, 10, 13, 20])
@pytest.mark.parametrize("ci,hw,k,padding", [
    (1, (28, 28), 5, (0, 0)), (1, (28, 28), 5, (2, 2)), (10, (12, 12), 5, (0, 0)), (1, (8, 8), 3, (1, 1)),  # the models'
    (3, (22, 10), 3, (0, 0)), (2, (16, 34), 3, (1, 1)), (1, (21, 30), 5, (0, 0)),  # overlapping row groups, column blocks, odd sizes
])
def test_the_kernel_is_conv_then_pool(c, ci, hw, k, padding):
    g = torch.Generator().manual_seed(c)
    x = torch.randn(5, ci, *hw, generator=g)
    w, b = torch.randn(c, ci, k, k, generator=g) / ci ** 0.5, torch.randn(c, generator=g)
    scale, shift = torch.rand(c, generator=g) + 0.1, torch.randn(c, generator=g)
    scale[1::2] *= -1  # both signs
    for bias in (b, None):
        got = convkernel.conv_pool(x, w, bias, padding)
        want = _reference(x, w, bias, padding)
        assert got is not None and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
        # the BatchNorm's affine map and the ReLU after the pool, in the kernel
        got = convkernel.conv_pool(x, w, bias, padding, scale, shift, relu=True)
        torch.testing.assert_close(got, torch.relu(want * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)),
                                   rtol=1e-5, atol=4e-5)
        assert (got == 0).any() and (got > 0).any() or c == 1  # the ReLU cut something and kept something
        torch.testing.assert_close(convkernel.conv_pool(x, w, bias, padding, relu=True), torch.relu(want), rtol=1e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("ci,hw", [(1, 28), (10, 12)])
def test_the_kernel_splits_rows_over_threads_with_the_same_bits(ci, hw):
    x, w, b = torch.randn(64, ci, hw, hw), torch.randn(10, ci, 5, 5), torch.randn(10)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = convkernel.conv_pool(x, w, b)
        torch.set_num_threads(2)
        assert torch.equal(convkernel.conv_pool(x, w, b), one)
        assert torch.equal(convkernel.conv_pool(x[7:9], w, b), one[7:9])  # a row's result does not depend on its chunk
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("ci,hw", [(1, 28), (10, 12)])
def test_the_kernel_propagates_nan_as_the_pool_does(ci, hw):
    x, w, b = torch.randn(2, ci, hw, hw), torch.randn(6, ci, 5, 5), torch.zeros(6)
    x[0, 0, 3, 7] = float("nan")
    got, want = convkernel.conv_pool(x, w, b), _reference(x, w, b, (0, 0))
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    got = convkernel.conv_pool(x, w, b, scale=torch.ones(6), shift=torch.zeros(6), relu=True)
    assert torch.equal(got.isnan(), torch.relu(want).isnan())  # the ReLU keeps NaN, as torch.relu does


def test_each_filter_count_takes_the_block_that_pads_it_least():
    assert [convkernel.block(c) for c in (1, 4, 5, 6, 10, 12, 16, 20, 32)] == [4, 4, 5, 6, 5, 6, 4, 5, 4]
    assert convkernel.waste(24, 24) == 1.0 and convkernel.waste(8, 8) == 1.0
    assert convkernel.waste(28, 28) == pytest.approx((32 / 28) * (16 / 14))


def test_the_kernel_declines_what_it_does_not_compute(monkeypatch):
    x, w = torch.randn(3, 1, 28, 28), torch.randn(6, 1, 5, 5)
    assert convkernel.conv_pool(torch.randn(3, 6, 14, 14), torch.randn(16, 6, 5, 5), None) is None  # 10×10: 2.56× the work
    assert convkernel.conv_pool(torch.randn(3, 1, 6, 6), torch.randn(6, 1, 3, 3), None) is None  # 4×4 out
    assert convkernel.conv_pool(torch.randn(3, 4, 8, 10), torch.randn(6, 4, 3, 3), None) is None  # 6 rows out
    assert convkernel.conv_pool(x.double(), w.double(), None) is None
    assert convkernel.conv_pool(x, w.requires_grad_(), None) is None
    assert convkernel.conv_pool(x, torch.randn(6, 1, 5, 3), None) is None
    monkeypatch.setenv(convkernel.ENV, "off")
    assert convkernel.conv_pool(x, torch.randn(6, 1, 5, 5), None) is None
    assert not convkernel.fits(nn.Conv2d(1, 6, 5, stride=2), (2, 2)) and not convkernel.fits(nn.Conv2d(1, 6, 5), (3, 3))
    assert convkernel.fits(nn.Conv2d(1, 6, 5, padding=2), (2, 2))
