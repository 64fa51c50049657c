"""The reordered CNN evaluation pass (flockfl.engine.convplan) gives the model's own outputs bit
for bit: conv → pool → ReLU for conv → ReLU → pool, and BatchNorm's affine map after the pool
with negative-scale channels' filters negated; models it does not know run as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from flockfl.engine import convplan
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
