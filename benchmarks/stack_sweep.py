"""Cells trained together (issue 31): one ``flockfl sweep`` of N seeds run with ``--no-stack`` (the
cells one by one, each its own Prefect flow), with the default stacking (up to 8 cells as one
stack: one flow, their passes trained together), and with ``--parallel 2`` (worker processes:
the stacks, or the runs one by one, in two processes), in one invocation, alternating, in one
project folder (its MLflow store, Prefect home and partitions warmed by one run first). Prints
each sweep's wall time (measured outside the process), its ratio to ``--no-stack``, each seed's
final accuracy and state digest in every mode (they must be equal), and the stacked sweep's
passes against its cells' requests.

Usage: python benchmarks/stack_sweep.py [--experiment ifca_rotated_digits] [--seeds 8] [--repeats 1]
       [--modes "--no-stack" "" "--parallel 2" "--no-stack --parallel 2"] [--set KEY=VALUE ...] [--json FILE]
(a mode is the sweep's extra flags, "" the default; ``--set tracking.enabled=false`` measures the
sweeps without MLflow.) Times on 2 shared cores are noisy: compare the modes within one invocation.
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


def sweep(project: Path, experiment: str, seeds: int, sets: list[str], flags: list[str], tag: str) -> dict:
    out = project / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "sweep", experiment, "--seeds", *map(str, range(seeds)), "--no-progress",
           "--json", "--sweep-dir", str(out), *[a for s in sets for a in ("--set", s)], *flags]
    env = {**os.environ, "FLOCKFL_RESIDENT": "off"}  # every sweep a fresh process, as a user's first command
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        sys.exit(f"sweep failed ({' '.join(flags) or 'default'}):\n{res.stderr[-3000:]}")
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
    ap.add_argument("--modes", nargs="+", default=["--no-stack", "", "--parallel 2", "--no-stack --parallel 2"],
                    help="each mode's extra flags (the first is the ratios' base)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)
    names = [m or "stacked (default)" for m in args.modes]
    with tempfile.TemporaryDirectory() as d:
        project = Path(d)
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        sweep(project, args.experiment, 1, args.sets, ["--no-stack"], "warm")  # store, Prefect home, partitions, caches
        rows: dict[str, list] = {n: [] for n in names}
        for _ in range(args.repeats):
            for i, (mode, name) in enumerate(zip(args.modes, names)):
                rows[name].append(sweep(project, args.experiment, args.seeds, args.sets, mode.split(), f"mode{i}"))
    walls = {n: statistics.median(r["wall_s"] for r in rows[n]) for n in names}
    base = walls[names[0]]
    print(f"{args.experiment}, {args.seeds} seeds{' ' + ' '.join(args.sets) if args.sets else ''}"
          f" (median of {args.repeats}, process wall time)\n")
    print("| sweep | wall s | ratio |\n|---|---|---|")
    for n in names:
        print(f"| {n} | {walls[n]:.1f} | {base / walls[n]:.2f} |")
    print("\n| seed | " + " | ".join(f"accuracy {n}" for n in names) + " | same state |\n|---|" + "---|" * (len(names) + 1))
    same = True
    first = rows[names[0]][-1]["children"]
    for key in sorted(first):
        cells = [rows[n][-1]["children"][key] for n in names]
        ok = all(c[1] == cells[0][1] for c in cells)
        same &= ok
        print(f"| {key} | " + " | ".join(f"{c[0]:.4f}" for c in cells) + f" | {'yes' if ok else 'NO'} |")
    stacked = next((n for n, m in zip(names, args.modes) if "--no-stack" not in m), None)
    info = next(iter(rows[stacked][-1]["children"].values()))[2] or {} if stacked else {}
    print(f"\n{stacked}: {info.get('cells')} cells a stack, {info.get('passes')} passes for {info.get('calls')} requests; "
          f"every state equal: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
