"""``pfl_cnn`` (pfl-research's CIFAR-10 ``simple_cnn`` without dropout) and benchmarks/pfl_compare.py."""

from __future__ import annotations

import subprocess

import pytest
import sys
from pathlib import Path

import numpy as np
import torch

from conftest import assert_trainers_agree, tiny_config
from flockfl.experiments import validate
from models import build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_pfl_cnn_has_the_layers_of_pfl_researchs_simple_cnn():
    """The same convolutions and dense layers, in order, as the benchmark's pfl-side model (pfl's
    own architecture with its dropouts): 1,626,442 parameters on 32×32×3."""
    import pfl_compare

    ours = [tuple(p.shape) for p in build_model("pfl_cnn", (3, 32, 32), 10).parameters()]
    theirs = [tuple(p.shape) for p in pfl_compare.pfl_model().parameters()]
    assert ours == theirs == [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 12544), (128,), (10, 128), (10,)]
    assert sum(int(np.prod(s)) for s in ours) == 1_626_442
    m = build_model("pfl_cnn", (3, 32, 32), 10)
    x = torch.randn(2, 3, 32, 32)
    assert m(x).shape == (2, 10)
    assert build_model("pfl_cnn", (1, 8, 8), 10)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)  # digits


def test_pfl_cnn_trains_alike_under_both_trainers(tmp_path):
    ref, vec = assert_trainers_agree(
        lambda e: validate(tiny_config(model={"name": "pfl_cnn"}, train={"engine": e, "rounds": 2})), tmp_path)
    assert np.isfinite(vec.history[-1]["loss"]) and vec.history[-1]["clients_dropped"] == 0


# a benchmark script as a process (6 s): the full suite's
@pytest.mark.slow
def test_pfl_compare_prints_flockfls_rows_without_pfl():
    """Without ``pfl`` installed (this venv) the script says so on one line and still times flockfl."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pfl_compare.py"), "--device", "cpu", "--users", "12",
                          "--per-user", "10", "--cohort", "3", "--rounds", "1", "--warmup", "0", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| flockfl")]
    assert [r.split(" | ")[0] for r in rows] == ["| flockfl vectorized (pfl_cnn)", "| flockfl reference (pfl_cnn)"]
    assert all(float(r.split(" | ")[1]) > 0 for r in rows)
    try:
        import pfl  # noqa: F401
    except ModuleNotFoundError:
        assert "pfl: not installed" in res.stderr
