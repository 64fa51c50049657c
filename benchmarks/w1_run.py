"""W1 through ``flockfl run`` with the defaults: the whole command's wall time and peak RSS
(``/usr/bin/time``; through the resident flockfl, the command's child's own peak, ``peak_rss_mb``), beside the run's own ``rounds_wall_s``, ``round_s_median`` and phases.

W1 (issue 33): FedAvg, Fashion-MNIST IID, 1,200 clients, 120 a round, MLP 784-200-10, 1 local
epoch, batch 10, lr 0.05, ``--rounds`` rounds (8). Everything else is flockfl's default:
tracking (a SQLite store in the project), the evaluation conventions, the final fine-tuned
evaluation, checkpoints. Each code tree runs in its own project folder (partition built and the
store created by one warm-up run, not timed), then ``--repeats`` times, trees interleaved; the
table gives medians. Compare trees measured in one invocation, on an otherwise idle machine.

Usage: python benchmarks/w1_run.py [--before DIR] [--after DIR] [--rounds 8] [--repeats 2]
  --before DIR  the code before, as a checkout (``git worktree add /tmp/w1-before <commit>``),
                run with this interpreter through PYTHONPATH
  --after DIR   the code after (default: this checkout)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def w1_config(rounds: int) -> dict:
    return {"name": "w1", "seed": 0, "dataset": {"name": "fashion_mnist"},
            "partition": {"scheme": "iid", "num_clients": 1200}, "model": {"name": "mlp", "hidden": 200},
            "algorithm": {"name": "fedavg"},
            "train": {"rounds": rounds, "clients_per_round": 120, "local_epochs": 1, "batch_size": 10, "lr": 0.05}}


def run_once(tree: Path, project: Path, tag: str, resident_dir: Path | None = None) -> dict:
    """One W1 run; ``resident_dir``: through the resident flockfl kept there (else a plain process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "FLOCKFL_CRASH", "FLOCKFL_RESIDENT",
                                                                    "FLOCKFL_WAIT"))}
    env.update(PYTHONPATH=str(tree), PREFECT_HOME=str(project / ".prefect"))
    env.update({"FLOCKFL_RESIDENT": "auto", "FLOCKFL_RESIDENT_DIR": str(resident_dir)} if resident_dir else
               {"FLOCKFL_RESIDENT": "off"})
    cmd = ["/usr/bin/time", "-f", "TIME %e %M", sys.executable, "-m", "flows.cli", "run", "w1.yaml", "--json",
           "--no-progress", "--run-dir", f"runs/{tag}", "--tracking-uri", f"sqlite:///{project}/mlflow.db",
           "--partitions", "parts"]
    res = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"w1 run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    wall, rss_kb = re.findall(r"TIME ([\d.]+) (\d+)", res.stderr)[-1]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    if summary.get("resident"):  # /usr/bin/time saw the client; the command ran in the resident's child
        rss_kb = summary["peak_rss_mb"] * 1024
    return {"wall": float(wall), "rss_gb": int(rss_kb) / 2**20, "rounds_wall_s": summary["rounds_wall_s"],
            "round_s_median": summary["round_s_median"], "phases": summary.get("phases_s", {}),
            "accuracy": summary["metrics"].get("accuracy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path)
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-resident", action="store_true", help="no row for the code after through its resident flockfl")
    args = ap.parse_args()
    trees = {"after": args.after.resolve()}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    work = Path(tempfile.mkdtemp(prefix="w1-run-"))
    projects, resident_dirs = {}, {}
    for name, tree in trees.items():
        p = projects[name] = work / name
        p.mkdir()
        (p / "w1.yaml").write_text(yaml.safe_dump(w1_config(args.rounds)))
        run_once(tree, p, "warm-up")
    if not args.no_resident:  # started by a first command, waited for, warmed by one run
        resident_dirs["after, resident"] = d = work / "resident"
        run_once(trees["after"], projects["after"], "start-resident", d)
        while not list(d.glob("*.sock")):
            time.sleep(0.5)
        run_once(trees["after"], projects["after"], "warm-resident", d)
    configs = [(name, tree, None) for name, tree in trees.items()] + \
              [(name, trees["after"], d) for name, d in resident_dirs.items()]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for i in range(args.repeats):
        for name, tree, d in configs:
            rows[name].append(run_once(tree, projects["after" if d else name], f"{name}-r{i}".replace(", ", "-"), d))
    for d in resident_dirs.values():
        for f in d.glob("*.pid"):
            os.kill(int(f.read_text()), 15)
    print(f"W1 through `flockfl run`, defaults, {args.rounds} rounds; medians of {args.repeats} "
          f"(threads: flockfl's default; machine: {os.cpu_count()} cores)\n")
    print("| code | wall s | peak RSS GB | rounds_wall_s | round_s_median | outside the rounds s | accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in rows.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"| {name} | {med('wall'):.1f} | {med('rss_gb'):.2f} | {med('rounds_wall_s'):.1f} | "
              f"{med('round_s_median'):.3f} | {med('wall') - med('rounds_wall_s'):.1f} | {rs[0]['accuracy']:.4f} |")
    for name, rs in rows.items():
        phases = {k: round(statistics.median(r["phases"].get(k, 0.0) for r in rs), 2) for k in rs[0]["phases"]}
        print(f"\n{name} phases (median s): {phases}")


if __name__ == "__main__":
    main()
