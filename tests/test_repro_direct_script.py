"""benchmarks/repro_direct.py (a table by the plain loop, for machines without Prefect/MLflow): its
cells stacked (the default) end where they end one by one, in the table it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two script processes of about 10 s each
def test_stacked_cells_print_the_table_of_cells_one_by_one(tmp_path):
    out = {}
    for mode, extra in (("stacked", []), ("one by one", ["--stack", "1"])):
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks/repro_direct.py"), "flexcfl_synthetic",
                              "--budget", "cpu", "--rows", "IFCA", "RCC", "--columns", "III: no shift",
                              "--seeds", "0", "--set", "train.rounds=2", "--set", "train.clients_per_round=100", "--json", str(tmp_path / f"{mode}.json"),
                              *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count(": finished") == 2
        assert "| IFCA | – |" not in res.stdout  # every client seen in round 1: the cells have their numbers
        out[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
        out[mode].pop("wall_s", None)
    strip = lambda d: json.dumps({k: v for k, v in d.items() if "wall" not in k}, sort_keys=True, default=str)  # noqa: E731
    assert strip(out["stacked"]) == strip(out["one by one"])
