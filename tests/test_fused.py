"""The fused SGD update (flockfl/engine/fused.py) gives eager PyTorch's bits: every combination of
its terms at one and two threads, and a whole vectorised FedProx / SCAFFOLD / masked pass with it
on and off. Where it cannot run (no compiler, another dtype, switched off) the eager path does."""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np
import pytest
import torch

from flockfl.engine import LocalSpec, fused, train_cohort
from flockfl.engine.functional import stack
from flockfl.rng import torch_generator
from models import build_model, init_params

from test_engine import random_clients

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler here: the eager path runs")


def eager(p, g, rate, wd=0.0, anchor=None, mu=None, corr=None, cmask=None, mask=None):
    """The trainer's eager operations, in its order (flockfl/engine/update.py GradientTerms)."""
    p, g = p.clone(), g.clone()
    if wd:
        g.add_(wd * p)
    if anchor is not None:
        g.add_(torch.sub(p, anchor).mul_(mu))
    if corr is not None:
        g.add_(corr)
    if cmask is not None:
        g.mul_(cmask.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1))))
    if mask is not None:
        g.mul_(mask)
    p.sub_(g.mul_(rate))
    return p


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def test_every_combination_of_terms_is_eagers_bits(threads):
    gen = torch.Generator().manual_seed(0)
    C, shape = 7, (7, 33, 1100)  # rows longer than the kernel's block, not a multiple of it
    for wd, prox, per_client_mu, shared_anchor, corr, cmask, mask, shared_mask in itertools.product(*[(0, 1)] * 8):
        if (not prox and (per_client_mu or shared_anchor)) or (not mask and shared_mask):
            continue
        p, g = torch.randn(shape, generator=gen), 3 * torch.randn(shape, generator=gen)
        anchor = torch.randn(shape[1:], generator=gen).expand(shape) if shared_anchor else torch.randn(shape, generator=gen)
        mu = torch.rand(C, 1, 1, generator=gen) if per_client_mu else 0.01
        c = 0.1 * torch.randn(shape, generator=gen)
        cm = torch.rand(C, generator=gen) > 0.3
        m = (torch.rand(shape[1:] if shared_mask else shape, generator=gen) > 0.5).float()
        kw = dict(wd=1e-3 if wd else 0.0, anchor=anchor if prox else None, mu=mu, corr=c if corr else None,
                  cmask=cm if cmask else None, mask=m if mask else None)
        want = eager(p, g, 0.037, **kw)
        got, g0 = p.clone(), g.clone()
        fused.sgd_update(got, g, 0.037, weight_decay=kw["wd"], anchor=kw["anchor"], mu=mu, correction=kw["corr"],
                         client_mask=kw["cmask"], mask=kw["mask"])
        assert torch.equal(got, want), kw.keys()
        assert torch.equal(g, g0)  # the gradient is read, not written
        assert not torch.equal(got, p)  # and it moved


def _pass(terms: str):
    data = random_clients([9, 17, 30, 12, 23])
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(5, client=i, purpose="init")) for i in range(5)])
    g = torch.Generator().manual_seed(3)
    extra = {"prox": {"prox_mu": 0.5},
             "correction": {"correction": {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in init.items()}},
             "masks": {"masks": {k: (torch.rand(v.shape, generator=g) > 0.4).float() for k, v in init.items()}},
             "decay": {"weight_decay": 1e-2, "prox_mu": 0.1}}[terms]
    spec = LocalSpec(np.arange(5), init, 0.05, batch_size=4, client_steps=np.array([1, 3, 6, 0, 4]), **extra)
    return init, train_cohort(model, spec, data.train, data.task, seed=0, round=1, method="func")


@pytest.mark.parametrize("terms", ["prox", "correction", "masks", "decay"])
def test_a_vectorised_pass_is_the_same_with_the_fused_update_on_and_off(terms, monkeypatch):
    calls = []
    real = fused.sgd_update
    monkeypatch.setattr(fused, "sgd_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    init, on = _pass(terms)
    assert calls, "the fused update did not run"
    monkeypatch.setenv(fused.ENV, "off")
    assert not fused.available()
    n = len(calls)
    _, off = _pass(terms)
    assert len(calls) == n  # switched off: the eager path ran
    for k in init:
        assert torch.equal(on.params[k], off.params[k]), k
        assert not torch.equal(on.params[k][0], init[k][0]), k
    np.testing.assert_array_equal(on.loss, off.loss)


def test_it_runs_only_on_float32_cpu_tensors():
    p = torch.randn(3, 4)
    assert fused.supported(p, torch.randn(3, 4))
    assert not fused.supported(p.double(), torch.randn(3, 4).double())
    assert not fused.supported(p.t(), torch.randn(4, 3))  # not contiguous
    assert not fused.supported(p, torch.randn(3, 5))


def test_scaffold_control_variates_are_eagers_bits(threads):
    gen = torch.Generator().manual_seed(1)
    C, shape = 9, (40, 1000)
    x, c = torch.randn(shape, generator=gen), 0.1 * torch.randn(shape, generator=gen)
    y, old = torch.randn(C, *shape, generator=gen), 0.1 * torch.randn(C, *shape, generator=gen)
    steps = torch.tensor([1, 3, 5, 5, 2, 7, 1, 4, 6], dtype=torch.float32)
    scale = (1.0 / (steps * 0.05)).reshape(-1, 1, 1)
    ci, diff = fused.scaffold_control(x, y, old, c, scale)
    want = torch.sub(old, c.unsqueeze(0)).add_(torch.sub(x.unsqueeze(0), y).mul_(scale))
    assert torch.equal(ci, want) and torch.equal(diff, torch.sub(want, old))
    assert fused.scaffold_control(x.double(), y.double(), old.double(), c.double(), scale.double()) is None


def test_a_forked_child_updates_on_threads_of_its_own(threads, tmp_path):
    """The resident flockfl forks a child per command: the parent's pool has no threads there.
    (The child runs only the kernel and numpy: torch's own OpenMP pool is not fork-safe.)"""
    gen = torch.Generator().manual_seed(2)
    p, g = torch.randn(8, 300, 300, generator=gen), torch.randn(8, 300, 300, generator=gen)
    fused.sgd_update(torch.from_numpy(p.numpy().copy()), g, 0.1)  # the parent's pool, at two threads
    pid = os.fork()
    if pid == 0:  # the child: writes its result, exits 0 if the update ran
        code = 1
        try:
            got = torch.from_numpy(p.numpy().copy())
            fused.sgd_update(got, g, 0.1)
            np.save(tmp_path / "child.npy", got.numpy())
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            assert np.array_equal(np.load(tmp_path / "child.npy"), eager(p, g, 0.1).numpy())
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's update did not finish in 60 s")
