"""benchmarks/eval_speed.py at a tiny size: it still runs against today's evaluation (it checks that
flockfl's per-client metrics equal the plain loop's before it times them, and once failed with a
KeyError when the default conventions stopped measuring a per-client model's label union)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


# a benchmark script as a process (6 s): the full suite's
@pytest.mark.slow
def test_eval_speed_runs_both_regimes_and_agrees_with_the_loop():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/eval_speed.py"), "--threads", "1", "--clients", "10",
                          "--repeat", "1", "--workloads", "mlp/digits"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("mlp/digits")]
    assert [r[1] for r in rows] == ["shared", "own"], res.stdout
    assert all(float(r[3]) > 0 and float(r[-1]) > 0 for r in rows)  # flockfl's time and its ratio to the floor
