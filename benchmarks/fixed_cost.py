"""A run's fixed cost: what one ``flockfl run`` spends outside its rounds, phase by phase, before
and after issue 22, standalone and inside a sweep, beside the import floor.

The workload is ``ifca_rotated_digits`` (params.yaml: digits, 40 clients, MLP 64-200-10, k=4, so
four models are exported and, standalone, registered) cut to ``--rounds`` rounds. Every
configuration (code tree × ``tracking.model_format``) runs ``--repeats`` times, interleaved,
in a project folder per code tree (that tree's params.yaml; its MLflow store, Prefect home and
partitions warmed up by one run first); the table shows medians. Times on 2 shared cores are noisy (±30 %): compare
medians, and the total, which no phase accounting can flatter.

- standalone: ``flockfl run … --json``; the phases come from its JSON (``phases_s``,
  ``rounds_wall_s``, ``process_wall_s``), the total is measured outside the process (its exit
  included). "before the flow body" is everything from the interpreter's start to the flow's
  first line: imports, config, the partition, the Prefect API and the flow run's creation.
- sweep: ``flockfl sweep … --seeds 0 … S-1`` (no registration, as sweeps do): the median fixed
  cost per run (``fixed_s_per_run_median``: a run's time in the sweep minus its rounds) and the
  whole sweep.
- floor: ``python -c "import torch, prefect, mlflow"``, and the same with the data and plot
  libraries this workload also needs (``sklearn.datasets``, ``matplotlib.pyplot``).

Usage: python benchmarks/fixed_cost.py [--baseline DIR] [--after DIR] [--repeats 3] [--rounds 2]
       [--formats pt2 pickle] [--seeds 3] [--json FILE]
  --baseline DIR  the code before, as a checkout (``git worktree add /tmp/fc-base 65a4ff9``),
                  run with this interpreter through PYTHONPATH
  --after DIR     the code after (default: this checkout); a checkout of the same commit with
                  only this change applied isolates it from other work in progress
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "ifca_rotated_digits"
# measured the way the CLI ends: os._exit, no interpreter teardown
FLOORS = {"import torch, prefect, mlflow": "import os, torch, prefect, mlflow; os._exit(0)",
          "… + sklearn.datasets, matplotlib.pyplot": "import os, torch, prefect, mlflow, sklearn.datasets, matplotlib.pyplot; os._exit(0)"}
RESIDENT_DIRS: dict[str, Path] = {}  # code tree -> the folder of its resident flockfl


def _env(tree: Path, project: Path, mode: str = "plain") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "FLOCKFL_CRASH", "FLOCKFL_RESIDENT",
                                                                    "FLOCKFL_WAIT"))}
    env.update(PYTHONPATH=str(tree), PREFECT_HOME=str(project / ".prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{project}/mlflow.db")
    if mode == "resident":
        env.update(FLOCKFL_RESIDENT="auto", FLOCKFL_RESIDENT_DIR=str(RESIDENT_DIRS.setdefault(str(tree), Path(
            tempfile.mkdtemp(prefix="flockfl-fc-resident-")))))
    else:
        env["FLOCKFL_RESIDENT"] = "off"
    return env


def start_resident(tree: Path, project: Path) -> None:
    """A first command starts the tree's resident; wait until it serves."""
    env = _env(tree, project, "resident")
    subprocess.run([sys.executable, "-m", "flows.cli", "list"], cwd=project, env=env, capture_output=True)
    deadline = time.monotonic() + 300
    while not list(Path(env["FLOCKFL_RESIDENT_DIR"]).glob("*.sock")):
        if time.monotonic() > deadline:
            raise SystemExit(f"no resident flockfl started for {tree}")
        time.sleep(0.5)


def stop_residents() -> None:
    for d in RESIDENT_DIRS.values():
        for f in d.glob("*.pid"):
            try:
                os.kill(int(f.read_text()), 15)
            except (OSError, ValueError):
                pass


def _flock(tree: Path, project: Path, args: list[str], mode: str = "plain") -> tuple[float, dict]:
    """One flockfl command: (seconds measured outside the process, its JSON summary)."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--json", "--no-progress"], cwd=project,
                         env=_env(tree, project, mode), capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"flockfl {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return wall, json.loads(res.stdout.strip().splitlines()[-1])


def standalone(tree: Path, project: Path, tag: str, rounds: int, fmt: str, mode: str = "plain") -> dict:
    wall, s = _flock(tree, project, ["run", EXPERIMENT, "--set", f"train.rounds={rounds}", "--set",
                                     f"tracking.model_format={fmt}", "--run-dir", f"runs/{tag}"], mode)
    p = s["phases_s"]
    close_wait = p.get("close_wait", 0.0)
    in_flow_models = p.get("models", 0.0)  # before: the export ran inside the flow, on the main thread
    known = p.get("partition", 0) + p.get("restore", 0) + p.get("tracker", 0) + s["rounds_wall_s"] + p.get("plots", 0) + in_flow_models
    return {
        "total (measured outside)": wall,
        "outside rounds (total − rounds)": wall - s["rounds_wall_s"],
        "outside_rounds_s (flockfl run --json)": s["outside_rounds_s"],
        "before the flow body": s["process_wall_s"] - s["wall_s"] - p.get("flow_end", 0.0) - close_wait,
        "  of which: API wait + flow-run start": p.get("api_wait", float("nan")) + p.get("flow_start", float("nan")),
        "partition + restore (in the flow)": p.get("partition", 0) + p.get("restore", 0),
        "tracker (main thread)": p.get("tracker", 0.0),
        "rounds (pre-federation included)": s["rounds_wall_s"],
        "plots": p.get("plots", 0.0),
        "models, on the main thread": in_flow_models + close_wait,
        "rest of the flow (artifacts, logging, …)": s["wall_s"] - known,
        "exit (after the JSON line)": wall - s["process_wall_s"],
        "background: open the MLflow run": s.get("tracking_s", {}).get("open", float("nan")),
        "background: export the models": s.get("tracking_s", {}).get("models", float("nan")),
    }


def sweep(tree: Path, project: Path, tag: str, rounds: int, fmt: str, seeds: int, mode: str = "plain") -> dict:
    wall, s = _flock(tree, project, ["sweep", EXPERIMENT, "--set", f"train.rounds={rounds}", "--set",
                                     f"tracking.model_format={fmt}", "--seeds", *map(str, range(seeds)),
                                     "--sweep-dir", f"runs/{tag}"], mode)
    return {"sweep: fixed cost per run (median)": s["fixed_s_per_run_median"], "sweep: the whole sweep (in-process)": s["wall_s"],
            "sweep: the whole process (measured outside)": wall}


def floor(imports: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", imports], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of the code before (e.g. commit 65a4ff9)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the code after (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["pt2", "pickle"], choices=["pt2", "pickle"])
    ap.add_argument("--seeds", type=int, default=3, help="runs per sweep (0: no sweep rows)")
    ap.add_argument("--modes", nargs="+", default=["plain", "resident"], choices=["plain", "resident"],
                    help="the code after as plain processes (FLOCKFL_RESIDENT=off) and/or through its resident "
                         "flockfl (started and waited for first); the code before runs plain")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args()

    trees = ([("before", args.baseline.resolve())] if args.baseline else []) + [("after", args.after.resolve())]
    configs = [(name, tree, fmt, mode) for name, tree in trees for fmt in args.formats
               for mode in (["plain"] if name == "before" else args.modes)]
    samples: dict[str, dict[str, list[float]]] = {f"{n} {f}" + (" resident" if m == "resident" else ""): {}
                                                  for n, _, f, m in configs}
    floors: dict[str, list[float]] = {k: [] for k in FLOORS}
    with tempfile.TemporaryDirectory(prefix="flockfl-fixed-cost-") as tmp:
        projects = {}
        for name, tree in trees:  # a project per tree, with that tree's params.yaml
            projects[name] = Path(tmp) / name
            projects[name].mkdir()
            (projects[name] / "params.yaml").write_text((tree / "params.yaml").read_text())
            # warm: the store, the Prefect database, the partition, the page cache
            standalone(tree, projects[name], "warm", args.rounds, args.formats[0])
            if name == "after" and "resident" in args.modes:
                start_resident(tree, projects[name])
                standalone(tree, projects[name], "warm-resident", args.rounds, args.formats[0], "resident")
        for i in range(args.repeats):
            for name, tree, fmt, mode in configs:
                key, project = f"{name} {fmt}" + (" resident" if mode == "resident" else ""), projects[name]
                rows = standalone(tree, project, f"{fmt}-{mode}-{i}", args.rounds, fmt, mode)
                if args.seeds:
                    rows.update(sweep(tree, project, f"sweep-{fmt}-{mode}-{i}", args.rounds, fmt, args.seeds, mode))
                for k, v in rows.items():
                    samples[key].setdefault(k, []).append(v)
                print(f"repeat {i + 1}/{args.repeats} {key}: {rows['total (measured outside)']:.2f} s total", file=sys.stderr,
                      flush=True)
            for k, code in FLOORS.items():
                floors[k].append(floor(code))
        stop_residents()

    cols = list(samples)
    med = {c: {k: statistics.median(v) for k, v in samples[c].items()} for c in cols}
    rows = list(next(iter(samples.values())))
    print(f"\nFixed cost of `flockfl run {EXPERIMENT} --set train.rounds={args.rounds}` (seconds, median of "
          f"{args.repeats}; 2 shared cores, ±30 %)\n")
    print("| phase | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for r in rows:
        cells = [f"{med[c][r]:.2f}" if med[c].get(r) == med[c].get(r) else "–" for c in cols]
        print(f"| {r} | " + " | ".join(cells) + " |")
    for k, v in floors.items():
        print(f"| floor: `{k}` | " + " | ".join([f"{statistics.median(v):.2f}"] * len(cols)) + " |")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "floors": floors, "rounds": args.rounds,
                                         "repeats": args.repeats}, indent=1))


if __name__ == "__main__":
    main()
