"""A ``flockfl repro`` table run in this process by the plain round loop, without Prefect or MLflow.

For a machine that has a GPU but not the tracking stack (the lent GPU images carry only
torch and the wheels one brings): the same table definition (configs/repro/), the same cells,
seeds and protocol, the same rendering beside the published numbers; each cell is
``flockfl.rounds.run_rounds`` on ``train.device`` (no checkpoints, no resume: a cell that
fails is reported and the rest go on). By default up to 8 cells train together (``--stack N``,
flockfl/engine/stacking.py: each cell its own rounds, their passes merged where they can share,
convolutions included on a GPU), which keeps a GPU busy when one small model cannot; ``--stack 1
--parallel N`` runs N cells at once in worker processes instead (spawned: CPU-bound Python does
not share one interpreter lock). Use ``flockfl repro`` wherever the stack is there.

  python benchmarks/repro_direct.py niid_bench_fmnist --device cuda --seeds 0
  python benchmarks/repro_direct.py niid_bench_fmnist --budget cpu --rows FedAvg --columns IID --seeds 0 --stack 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table")
    ap.add_argument("--budget")
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--columns", nargs="+")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--stack", type=int, default=8, metavar="N", help="cells trained together at most (1: one by one)")
    ap.add_argument("--parallel", type=int, default=1, help="with --stack 1: cells at once, in worker processes")
    ap.add_argument("--json", help="write the table's JSON here")
    ap.add_argument("--progress", action="store_true",
                    help="print every evaluated round's accuracy (a run cut short still shows how far it got)")
    args = ap.parse_args(argv)

    from flows.repro_plan import plan_repro
    from flows.repro_render import describe_setting, render

    overrides = [*args.overrides, f"train.device={args.device}", "tracking.enabled=false"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_repro(args.table, args.budget, args.seeds, args.rows, args.columns, overrides,
                          str(ROOT / "params.yaml"), tmp)
        print(f"## {plan.table.title}\n\n{describe_setting(plan)}\n", flush=True)
        lock = threading.Lock()

        def run(child, t=None, outcome=None) -> None:
            t = t or time.perf_counter()
            try:
                if outcome is None:
                    outcome = cell(child.cfg, tmp, args.progress, child.key)
                elif isinstance(outcome, BaseException):
                    raise outcome
                child.summary = outcome
                child.summary["wall_s"] = time.perf_counter() - t
                child.status = "finished"
            except Exception as err:  # one cell failing does not stop the table
                child.status, child.error = "failed", f"{type(err).__name__}: {err}"
            with lock:
                acc = (child.summary or {}).get("metrics", {}).get("accuracy")
                print(f"  {child.key}: {child.status}" + (f", accuracy {acc:.4f}" if acc is not None else "")
                      + (f" ({child.error})" if child.error else "") + f", {time.perf_counter() - t:.1f} s", flush=True)

        from flockfl.data.store import build_partition

        for child in plan.sweep.children:  # once each, before any thread: two threads would write one file
            build_partition(child.cfg, Path(tmp) / "partitions")
        children = plan.sweep.children
        if args.stack > 1:
            from flockfl.engine.stacking import Stack

            for a in range(0, len(children), args.stack):
                part, t = children[a:a + args.stack], time.perf_counter()
                out = Stack().run([lambda c=c: cell(c.cfg, tmp, args.progress, c.key) for c in part])
                for child, (value, err) in zip(part, out):
                    run(child, t, value if err is None else err)
        elif args.parallel > 1:
            ctx = multiprocessing.get_context("spawn")  # a CUDA context does not survive a fork
            with ProcessPoolExecutor(args.parallel, mp_context=ctx) as pool:
                futures = [(c, time.perf_counter(), pool.submit(cell, c.cfg, tmp, args.progress, c.key)) for c in children]
                for child, t, fut in futures:
                    run(child, t, fut.exception() or fut.result())
        else:
            for child in children:
                run(child)
        text, data = render(plan)
    print(f"\n{text}\n")
    for source, v in data["within_tolerance"].items():
        print(f"{v['within']} of {v['of']} cells within ±{v['points']:g} points of {source}")
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": args.table, "budget": plan.budget, **data}, indent=1, default=str))
    return 0 if all(c.status == "finished" for c in plan.sweep.children) else 1


def cell(cfg, tmp: str, show: bool, key: str) -> dict:
    """One cell's run by the plain loop (in this process, a stack's thread or a worker process)."""
    from flockfl.eval_summary import summarise
    from flockfl.rounds import prepare, run_rounds

    def on_round(state, row) -> None:
        if row.get("accuracy") is not None:
            print(f"    {key} round {row['round']}: accuracy {row['accuracy']:.4f}, {row.get('round_time_s', 0):.1f} s",
                  flush=True)

    return summarise(run_rounds(prepare(cfg, Path(tmp) / "partitions"), on_round=on_round if show else None))


if __name__ == "__main__":
    sys.exit(main())
