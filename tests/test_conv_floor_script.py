"""benchmarks/conv_floor.py: its space-to-depth rewrite computes the convolution and pool it times
against, and the script prints every row."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("co,k", [(6, 5), (10, 5), (4, 3)])
def test_space_to_depth_is_the_convolution_then_the_pool(co, k):
    from conv_floor import s2d_weight

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1, 28, 28, generator=g), torch.randn(co, 1, k, k, generator=g)
    want = F.max_pool2d(F.conv2d(x, w), 2)
    side = 14 - (k + 2) // 2 + 1  # the 14×14 phases under the rewritten filters
    assert want.shape[-1] == side
    got = F.conv2d(F.pixel_unshuffle(x, 2), s2d_weight(w)).view(3, 4, co, side, side).amax(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# a benchmark script as a process (10-20 s): the full suite's
@pytest.mark.slow
def test_the_script_prints_every_row():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/conv_floor.py"), "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith(("conv1 ", "conv2 "))]
    from flockfl.engine import convkernel

    assert len(rows) == (27 if convkernel.available() else 24), res.stdout
    # every row's time, floor and ratio are numbers (not their sizes: a benchmark's ratios move with the
    # machine's load, and the floor's matmul peak measured 15.8 instead of 68-95 GFLOP/s under another suite)
    assert all(float(v) > 0 for ln in rows for v in ln.split()[-3:]), res.stdout
