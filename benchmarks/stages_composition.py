"""Curriculum and pruning composed with clustered algorithms, each run through ``flockfl run``
(Prefect flow, checkpoints, MLflow), next to the same algorithms without the stages.

Runs (bundled digits, offline):
- ``pacfl`` on ``digits_dirichlet`` (Dir(0.1), 50 clients), plain and with a data curriculum
  (s_G, linear, a = 0.8, b = 0.2, ordering curr);
- ``ifca`` on ``ifca_rotated_digits`` (4 rotations, 40 clients), plain and with unstructured
  pruning (target 50 %, rate 10 %, Acc_th 0.5);
- ``pacfl`` with the curriculum *and* unstructured pruning.

For every run the table gives the final accuracy (each client with its cluster model), the
accuracy after one local epoch, the subnetwork accuracy and sparsity when pruning, the bytes sent,
and which stage metrics reached MLflow (read back from the tracking store).

  python benchmarks/stages_composition.py
  python benchmarks/stages_composition.py --rounds 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CURR = ["curriculum.ordering=curr"]
PRUNE = ["pruning.method=unstructured", "pruning.target=0.5", "pruning.rate=0.1"]
STAGE_METRICS = ("difficulty_std", "sparsity", "clients_pruned", "mask_distance", "bytes_thesis", "accuracy_pruned")


def runs() -> dict[str, tuple[str, list[str]]]:
    pacfl = ["algorithm.name=pacfl", "algorithm.cut=largest_gap"]  # PACFL needs a β or a k; the library's cut
    return {
        "pacfl + largest-gap cut": ("digits_dirichlet", pacfl),
        "pacfl + largest-gap cut + curriculum": ("digits_dirichlet", pacfl + CURR),
        "ifca + k-means start": ("ifca_rotated_digits", []),
        "ifca + k-means start + unstructured pruning": ("ifca_rotated_digits", PRUNE),
        "pacfl + largest-gap cut + curriculum + pruning": ("digits_dirichlet", pacfl + CURR + PRUNE),
    }


def flock_run(experiment: str, sets: list[str], rounds: int, tmp: Path, name: str) -> tuple[dict, float]:
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "flows.cli", "run", experiment, "--json", "--run-dir", str(tmp / "runs" / name),
           "--tracking-uri", uri, "--set", f"train.rounds={rounds}", "--set", "tracking.register_model=false"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode != 0:
        raise SystemExit(f"{name}: flockfl run failed ({res.returncode}): {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def logged_metrics(uri: str, run_id: str) -> set[str]:
    from mlflow.tracking import MlflowClient

    return set(MlflowClient(uri).get_run(run_id).data.metrics)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, (exp, sets) in runs().items():
            summary, wall = flock_run(exp, sets, args.rounds, tmp, name.replace(" ", "_").replace("+", ""))
            metrics = summary["metrics"]
            seen = logged_metrics(f"sqlite:///{tmp / 'mlflow.db'}", summary["run_id"])
            out[name] = (metrics, wall, sorted(m for m in STAGE_METRICS if m in seen))
            print(f"  {name}: {wall:.0f}s", flush=True)
    print(f"\n{args.rounds} rounds each, through flockfl run (digits)")
    print("| run | accuracy | accuracy after 1 local epoch | subnetwork accuracy | sparsity | MB sent | ARI | "
          "stage metrics in MLflow | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (m, wall, seen) in out.items():
        f = lambda k: f"{100 * m[k]:.2f}" if k in m else "–"  # noqa: E731
        print(f"| {name} | {f('accuracy')} | {f('accuracy_finetuned')} | {f('accuracy_pruned')} | "
              f"{f('sparsity')} | {m.get('comm_bytes', 0) / 1e6:.2f} | {m.get('ari', float('nan')):.2f} | "
              f"{', '.join(seen) or '–'} | {wall:.0f} |")


if __name__ == "__main__":
    main()
