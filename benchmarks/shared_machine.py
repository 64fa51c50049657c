"""Two ``flockfl run``s on one machine: one alone against two started together, and whether the
results stay bit-identical whatever the sharing.

Workload W1 (as in round_speed.py): FedAvg, MLP 784-200-10, 1,200 clients, 120 a round, 1 local
epoch, batch 10, lr 0.05, ``--rounds`` rounds (40), ``train.engine=vectorized`` (``auto`` times
both trainers and could choose by load, and then the bits), on Fashion-MNIST IID (60,000
images, 50 a client; ``apt-get install dataset-fashion-mnist``), else on round_speed.py's
synthetic W1 data. Tracking is off (``--tracking`` turns it on, one SQLite store per run), and
so is the final fine-tuned evaluation (``--finetune`` restores ``train.eval_finetune=final``:
1,200 fine-tuned models each evaluated on every test sample of its labels, ~100 s on 2 cores,
which then outweighs the 40 rounds).

Scenarios (each process's wall time is measured outside it, from its start to its exit):

- ``alone``: one run, flockfl's defaults (OpenMP passive wait, core lease);
- ``alone-spin``: one run with OpenMP's own wait policy (``OMP_WAIT_POLICY=`` exported empty:
  idle threads spin a while before they sleep), the single-run effect of the passive wait;
- ``pair``: two runs started together, defaults: the core lease (flockfl/cores.py) makes them
  take turns on the cores for their rounds; the second sets up meanwhile, waits for the cores
  the first leased, and says so on stderr;
- ``pair-nolease``: two together with ``FLOCKFL_CORE_LEASE=off``: both train at once (passive wait);
- ``pair-before``: two together as before this change: no lease, OpenMP's own wait policy.

One untimed run warms the files up first. A pair's ratio is each run's wall time over the
``alone`` run of the same repeat; the table gives
the median and the range over repeats. Scenarios rotate their order from repeat to repeat. The
leases live in a private folder (``FLOCKFL_CORES_DIR``): other flockfl runs on this machine
neither wait for these nor delay them. The last column checks that every run of every scenario
ends in the same ``state_sha256``.

Usage: python benchmarks/shared_machine.py [--rounds 40] [--repeats 3]
           [--scenarios alone,alone-spin,pair,pair-nolease,pair-before] [--json FILE] [--tracking] [--finetune]
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
FMNIST = Path("/usr/share/datasets/fashion-mnist")
SCENARIOS = {  # name: (runs started together, environment)
    "alone": (1, {}),
    "alone-spin": (1, {"OMP_WAIT_POLICY": ""}),
    "pair": (2, {}),
    "pair-nolease": (2, {"FLOCKFL_CORE_LEASE": "off"}),
    "pair-before": (2, {"FLOCKFL_CORE_LEASE": "off", "OMP_WAIT_POLICY": ""}),
}


def w1_config(work: Path, rounds: int, tracking: bool, finetune: bool = False) -> dict:
    if (FMNIST / "train-images-idx3-ubyte.gz").exists():
        dataset = {"name": "fashion_mnist", "path": str(FMNIST)}
        partition = {"scheme": "iid", "num_clients": 1200}
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from round_speed import make_npz

        make_npz(work / "w1.npz")
        dataset = {"name": "npz", "path": str(work / "w1.npz")}
        partition = {"scheme": "natural", "num_clients": 1200}
    return {"name": "w1", "seed": 0, "dataset": dataset, "partition": partition,
            "model": {"name": "mlp", "hidden": 200}, "algorithm": {"name": "fedavg"},
            "train": {"rounds": rounds, "clients_per_round": 120, "local_epochs": 1, "batch_size": 10, "lr": 0.05,
                      "engine": "vectorized", "eval_finetune": "final" if finetune else "off"},
            "tracking": {"enabled": tracking, "register_model": False}}


def env_for(work: Path, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "FLOCKFL_CRASH", "MLFLOW_TRACKING_URI"))}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(work / ".prefect"), FLOCKFL_CORES_DIR=str(work / "cores"))
    env.update(extra)
    return env


def scenario(work: Path, name: str, tag: str) -> list[dict]:
    """Start the scenario's runs together; each one's wall time, summary and waiting line."""
    n, extra = SCENARIOS[name]
    procs = []
    for i in range(n):
        run = f"{tag}-{name}-{i}"
        cmd = [sys.executable, "-m", "flows.cli", "run", "w1.yaml", "--run-dir", f"runs/{run}", "--json", "--no-progress",
               "--partitions", "parts", "--tracking-uri", f"sqlite:///{work}/mlflow-{run}.db"]
        out, err = open(work / f"{run}.out", "w+"), open(work / f"{run}.err", "w+")
        procs.append((subprocess.Popen(cmd, cwd=work, env=env_for(work, extra), stdout=out, stderr=err, text=True),
                      time.perf_counter(), out, err))
    ended: dict[int, float] = {}
    while len(ended) < len(procs):  # each run's own exit time (waiting on them in turn would not give it)
        for i, (p, t0, _, _) in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.perf_counter() - t0
        time.sleep(0.05)
    rows = []
    for i, (p, t0, out, err) in enumerate(procs):
        wall = ended[i]
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
        if p.returncode:
            raise SystemExit(f"{name}: flockfl run failed ({p.returncode}):\n{errors[-3000:]}")
        s = json.loads(text.strip().splitlines()[-1])
        waiting = [ln for ln in errors.splitlines() if "waiting for" in ln]
        rows.append({"wall_s": wall, "rounds_wall_s": s["rounds_wall_s"], "round_s_median": s["round_s_median"],
                     "cores_wait_s": s.get("cores_wait_s"), "cores_queued_s": s.get("cores_queued_s"),
                     "threads": s["threads"], "state_sha256": s["state_sha256"], "waiting_line": waiting[0] if waiting else None})
    return sorted(rows, key=lambda x: x["wall_s"])  # the first to finish, then the second


def spread(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--json", help="append every measurement here, as it comes (one JSON object a line)")
    ap.add_argument("--tracking", action="store_true", help="MLflow tracking on (one SQLite store per run)")
    ap.add_argument("--finetune", action="store_true", help="train.eval_finetune=final (the default of flockfl run)")
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    args = ap.parse_args()
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if any(n.startswith("pair") for n in names) and "alone" not in names:
        names.insert(0, "alone")  # the ratios' reference

    import yaml

    with tempfile.TemporaryDirectory(prefix="flockfl-shared-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cfg = w1_config(work, args.rounds, args.tracking, args.finetune)
        (work / "w1.yaml").write_text(yaml.safe_dump(cfg))
        subprocess.run([sys.executable, "-m", "flows.cli", "partition", "w1.yaml", "--out", "parts"], cwd=work,
                       env=env_for(work, {}), check=True, capture_output=True)  # built once, before any run is timed
        scenario(work, "alone", "warm-up")  # the first run after the partition reads cold files: not timed
        print(f"W1: FedAvg, MLP 784-200-10, {cfg['dataset']['name']} {cfg['partition']['scheme']}, 1200 clients, 120 a round, "
              f"{args.rounds} rounds, engine vectorized, tracking {'on' if args.tracking else 'off'}, "
              f"final fine-tuned evaluation {'on' if args.finetune else 'off'}; "
              f"cores: {len(os.sched_getaffinity(0))}; {args.repeats} repeats", flush=True)
        results: dict[str, list[list[dict]]] = {n: [] for n in names}
        alone_by_repeat: dict[int, float] = {}
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                load = os.getloadavg()[0]
                rows = scenario(work, name, f"r{r}")
                results[name].append(rows)
                if name == "alone":
                    alone_by_repeat[r] = rows[0]["wall_s"]
                line = {"repeat": r, "scenario": name, "load_1min": load, "runs": rows}
                print(f"  repeat {r} {name:13s} load {load:4.1f}: wall " + ", ".join(f"{x['wall_s']:.1f}" for x in rows)
                      + " s; rounds " + ", ".join(f"{x['rounds_wall_s']:.1f}" for x in rows) + " s; cores_wait "
                      + ", ".join(f"{x['cores_wait_s']:.1f}" for x in rows) + " s", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(line) + "\n")
        digests = {x["state_sha256"] for rs in results.values() for rows in rs for x in rows}
        ref = {x["state_sha256"] for rows in results.get("alone", []) for x in rows}
        print()
        print("| scenario | runs together | wall s per run, median (min–max) | × alone, first / second to finish, median (min–max) | "
              "rounds s | cores_wait_s | final state = alone's |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            n = SCENARIOS[name][0]
            walls = [x["wall_s"] for rows in results[name] for x in rows]
            ratios = []
            for i in range(n):
                ratios.append([rows[i]["wall_s"] / alone_by_repeat[r] for r, rows in enumerate(results[name])
                               if r in alone_by_repeat])
            same = all(x["state_sha256"] in ref for rows in results[name] for x in rows) if ref else None
            print(f"| {name} | {n} | {spread(walls)} | {' / '.join(spread(rs) for rs in ratios)} | "
                  f"{spread([x['rounds_wall_s'] for rows in results[name] for x in rows])} | "
                  f"{spread([x['cores_wait_s'] for rows in results[name] for x in rows])} | "
                  f"{'yes' if same else ('no' if same is False else '–')} |")
        print()
        if "pair" in results and alone_by_repeat:  # the bar: each of two runs within 2.2x one alone
            worst = max(rows[i]["wall_s"] / alone_by_repeat[r] for r, rows in enumerate(results["pair"])
                        if r in alone_by_repeat for i in range(len(rows)))
            print(f"pair (defaults): the slower of two runs started together took {worst:.2f}x one alone at worst "
                  f"(bar: 2.2x) -> {'met' if worst <= 2.2 else 'NOT met'}")
        print(f"distinct final states over all {sum(len(rows) for rs in results.values() for rows in rs)} runs: {len(digests)}")
        waits = [x["waiting_line"] for rs in results.values() for rows in rs for x in rows if x["waiting_line"]]
        if waits:
            print(f"a waiting run said: {waits[0]}")


if __name__ == "__main__":
    main()
