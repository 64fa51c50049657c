"""Cells trained together (issue 31): one ``flockfl sweep`` of N seeds run with ``--no-stack`` (the
cells one by one, each its own Prefect flow) and with the default stacking (up to 8 cells as one
stack: one flow, their passes trained together), in one invocation, alternating, in one project
folder (its MLflow store, Prefect home and partitions warmed by one run first). Prints each
sweep's wall time (measured outside the process), the ratio, each seed's final accuracy and state
digest in both modes (they must be equal), and the stacked sweep's passes against its cells'
requests.

Usage: python benchmarks/stack_sweep.py [--experiment ifca_rotated_digits] [--seeds 8] [--repeats 1]
       [--set KEY=VALUE ...] [--json FILE]
(``--set tracking.enabled=false`` measures the sweeps without MLflow.) Times on 2 shared cores are
noisy: compare the two modes within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sweep(project: Path, experiment: str, seeds: int, sets: list[str], stacked: bool, tag: str) -> dict:
    out = project / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "sweep", experiment, "--seeds", *map(str, range(seeds)), "--no-progress",
           "--json", "--sweep-dir", str(out), *[a for s in sets for a in ("--set", s)]] + ([] if stacked else ["--no-stack"])
    env = {**os.environ, "FLOCKFL_RESIDENT": "off"}  # every sweep a fresh process, as a user's first command
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        sys.exit(f"sweep failed ({'stacked' if stacked else '--no-stack'}):\n{res.stderr[-3000:]}")
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    kids = {k: (v["summary"]["metrics"]["accuracy"], v["summary"]["state_sha256"], v["summary"].get("stack"))
            for k, v in runs.items()}
    return {"wall_s": wall, "summary_wall_s": summary["wall_s"], "children": kids}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="ifca_rotated_digits")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        project = Path(d)
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        sweep(project, args.experiment, 1, args.sets, False, "warm")  # store, Prefect home, partitions, caches
        rows = {"--no-stack": [], "stacked": []}
        for _ in range(args.repeats):
            for stacked in (False, True):
                rows["stacked" if stacked else "--no-stack"].append(
                    sweep(project, args.experiment, args.seeds, args.sets, stacked, "stack" if stacked else "one"))
    one, st = rows["--no-stack"], rows["stacked"]
    a, b = statistics.median(r["wall_s"] for r in one), statistics.median(r["wall_s"] for r in st)
    print(f"{args.experiment}, {args.seeds} seeds{' ' + ' '.join(args.sets) if args.sets else ''}"
          f" (median of {args.repeats}, process wall time)\n")
    print("| sweep | wall s | ratio |\n|---|---|---|")
    print(f"| --no-stack (one by one) | {a:.1f} | 1.00 |")
    print(f"| stacked (default) | {b:.1f} | {a / b:.2f} |")
    print("\n| seed | accuracy --no-stack | accuracy stacked | same state |\n|---|---|---|---|")
    same = True
    for key in sorted(one[-1]["children"]):
        x, y = one[-1]["children"][key], st[-1]["children"][key]
        same &= x[1] == y[1]
        print(f"| {key} | {x[0]:.4f} | {y[0]:.4f} | {'yes' if x[1] == y[1] else 'NO'} |")
    info = next(iter(st[-1]["children"].values()))[2] or {}
    print(f"\nstacked: {info.get('cells')} cells a stack, {info.get('passes')} passes for {info.get('calls')} requests; "
          f"every state equal: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
