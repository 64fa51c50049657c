"""Clusters found without k or a hand-set threshold: every ``auto`` key on five partitions.

For each clustered method with an ``auto`` key (PACFL β, FLIS-DC β, FLIS-HC β, FedAC K, CFL's split
decision, IFCA's k with the k-means start, FlexCFL's m) and each partition, over several seeds:
the number of clusters ``auto`` chose and the ARI of the clients' final clusters against the true
groups (``ari`` of the last round's evaluation; the same number as ``flockfl run --json``'s
``metrics.ari``). For the methods that cut a dendrogram once (PACFL, FLIS-HC) the table also gives
the best ARI that *any* threshold reaches on the same matrix: where that is low, the method cannot
see the structure at all (a property of its measure, named in the note), and no threshold rule
can help.

Partitions (digits unless said; 30 clients, all training every round):

- ``disjoint3``: SC-NIID(100 %), 3 super clusters, a client holds every label of its super cluster;
- ``rotated4``: 4 rotations (0/90/180/270°);
- ``label_swap4``: 4 groups, each a random label permutation;
- ``mix``: Fashion-MNIST + digits, one source per client (2 groups, disjoint label spaces);
- ``iid``: nothing to find (the answer is 1 cluster).

The budget is the same for every method and seed and is printed; it runs through the plain loop
(``flockfl.rounds``), the same stages the flow runs, without MLflow.

  python benchmarks/auto_clusters.py                      # 5 seeds, every method and partition
  python benchmarks/auto_clusters.py --seeds 1 --methods pacfl flis_hc --partitions rotated4
  python benchmarks/auto_clusters.py --methods cfl --rounds cfl=40   # CFL given 40 rounds instead of 26

FLIS-DC re-clusters every round, so instead of a best threshold on one matrix its cells give the best
final ARI of the same budget run at each fixed β of a grid (0.1, 0.3, …, 0.9; ``--no-beta-grid`` skips it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIGITS = ["dataset.name=digits", "model.name=mlp", "model.hidden=64", "partition.num_clients=30",
          "train.clients_per_round=30", "train.batch_size=10", "train.lr=0.1", "partition.server_holdout=300",
          "train.engine=reference", "train.eval_every=1000", "train.threads=1"]
PARTITIONS = {
    "disjoint3": DIGITS + ["partition.scheme=sc_niid", "partition.rho=100", "partition.sc_clusters=3"],
    "rotated4": DIGITS + ["partition.scheme=rotated", "partition.k=4"],
    "label_swap4": DIGITS + ["partition.scheme=label_swap", "partition.k=4", "partition.label_swap_mode=random_perm"],
    "mix": ["dataset.name=mix", "dataset.sources=[fashion_mnist,digits]", "partition.scheme=mix", "model.name=mlp",
            "model.hidden=64", "partition.num_clients=30", "partition.samples_per_client=60",
            "train.clients_per_round=30", "train.batch_size=10",
            "train.lr=0.1", "partition.server_holdout=300", "train.engine=reference", "train.eval_every=1000", "train.threads=1"],
    "iid": DIGITS + ["partition.scheme=iid"],
}
TRUE_K = {"disjoint3": 3, "rotated4": 4, "label_swap4": 4, "mix": 2, "iid": 1}
# each method with its auto key; rounds and local epochs are the budget (FLIS compares what the
# clients' models predict: they must fit their data first, hence 20 local epochs for its pass)
METHODS = {
    "pacfl": (["algorithm.name=pacfl", "algorithm.beta=auto"], 1, 1),
    "flis_hc": (["algorithm.name=flis_hc", "algorithm.beta=auto", "algorithm.server_data_size=300"], 1, 20),
    # FLIS-DC decides each round and a choice counts the round after it repeats: 8 rounds (at 3, the
    # four label-swapped groups found in round 2 could not be confirmed before the end)
    "flis_dc": (["algorithm.name=flis_dc", "algorithm.beta=auto", "algorithm.server_data_size=300"], 8, 10),
    "fedac": (["algorithm.name=fedac", "algorithm.k=auto"], 10, 2),
    "cfl": (["algorithm.name=cfl", "algorithm.eps1=auto", "algorithm.eps2=auto"], 26, 2),  # the code's 20-round warm-up
    "ifca": (["algorithm.name=ifca", "algorithm.k=auto", "algorithm.init=pretrain_kmeans"], 3, 2),
    "flexcfl": (["algorithm.name=flexcfl", "algorithm.k=auto"], 3, 2),
}
# the matrix a one-shot method cuts, as a distance, and its linkage (for the best-any-threshold ARI)
MATRICES = {"pacfl": ("pacfl_proximity", False, "weighted"), "flis_hc": ("flis_similarity", True, "average")}


def best_any_threshold(state, prep, method: str) -> float:
    from flockfl.clustering import ari, hierarchical_clusters

    name, similarity, linkage = MATRICES[method]
    m = state.algo["matrices"][name].numpy()
    d = 1.0 - m if similarity else m
    truth = prep.ctx.data.group[prep.ctx.seen]
    return max(ari(truth, hierarchical_clusters(d, n_clusters=k, linkage=linkage)) for k in range(1, len(d) + 1))


# FLIS-DC re-clusters every round, so no single matrix holds "the best any β": the same budget is
# run at each fixed β of this grid instead, and the best final ARI among them is reported
FLIS_DC_GRID = (0.1, 0.3, 0.5, 0.7, 0.9)


def trained(method: str, partition: str, seed: int, params: str, parts: str, rounds: int | None = None,
            extra: tuple[str, ...] = ()):
    from flockfl.experiments import load_experiment
    from flockfl.rounds import prepare, run_rounds

    over, default_rounds, epochs = METHODS[method]
    cfg = load_experiment("configs/thesis_base.yaml", PARTITIONS[partition] + over + list(extra) + [
        f"seed={seed}", f"train.rounds={rounds or default_rounds}", f"train.local_epochs={epochs}",
        "tracking.enabled=false"], params)
    prep = prepare(cfg, parts)
    return prep, run_rounds(prep)


def best_fixed_beta(partition: str, seed: int, params: str, parts: str) -> float:
    """FLIS-DC: the best final ARI (each participant's own neighbourhood) over FLIS_DC_GRID."""
    from flockfl.clustering import ari

    best = 0.0
    for beta in FLIS_DC_GRID:
        prep, state = trained("flis_dc", partition, seed, params, parts, extra=(f"algorithm.beta={beta}",))
        truth = prep.ctx.data.group[prep.ctx.seen]
        best = max(best, float(ari(truth, state.assignments[prep.ctx.seen])))
    return best


def one(method: str, partition: str, seed: int, params: str, parts: str, rounds: int | None = None,
        grid: bool = True) -> dict:
    from flockfl.clustering import ari

    t0 = time.perf_counter()
    prep, state = trained(method, partition, seed, params, parts, rounds)
    seen = prep.ctx.seen
    recs = state.meta.get("auto_choices", [])
    last = recs[-1] if recs else {}
    truth = prep.ctx.data.group[seen]
    row = {"method": method if rounds is None else f"{method} ({rounds} rounds)", "partition": partition,
           "seed": seed, "k": int(state.k),
           "ari": float(ari(truth, state.assignments[seen])),
           "decisions": len(recs), "last_k": last.get("k"), "margin": last.get("margin"), "wall_s": time.perf_counter() - t0}
    if method == "flis_dc":
        # overlapping clusters: k is the number of clusters the last round's choice made, the ARI is
        # that of each participant's own neighbourhood (state.assignments); ari_pick is the ARI of
        # the model each client picks at evaluation (lowest local test loss among the T models)
        row["k"] = int(last.get("k", state.k))
        row["ari_pick"] = float(state.history[-1].get("ari", np.nan))
        if grid and TRUE_K[partition] > 1:
            row["best_fixed_beta"] = best_fixed_beta(partition, seed, params, parts)
    if method in MATRICES:
        row["best_any_threshold"] = best_any_threshold(state, prep, method)
    return row


def report(rows: list[dict], seeds: int) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    partitions = list(dict.fromkeys(r["partition"] for r in rows))
    lines = ["| method | " + " | ".join(f"{p} (true k={TRUE_K[p]})" for p in partitions) + " |",
             "|---|" + "---|" * len(partitions)]
    for m in methods:
        cells = []
        for p in partitions:
            rs = [r for r in rows if r["method"] == m and r["partition"] == p]
            if not rs:
                cells.append("–")
                continue
            a = np.array([r["ari"] for r in rs])
            ks = [r["k"] for r in rs]
            if TRUE_K[p] == 1:  # no groups: the ARI says nothing, the number of clusters is the answer
                cells.append(f"k {'/'.join(str(k) for k in ks)}")
                continue
            cell = f"ARI {np.nanmean(a):.2f} (min {np.nanmin(a):.2f}), k {'/'.join(str(k) for k in ks)}"
            if "best_any_threshold" in rs[0]:
                cell += f"; best any β {np.mean([r['best_any_threshold'] for r in rs]):.2f}"
            if "ari_pick" in rs[0]:
                cell += f"; picked models {np.nanmean([r['ari_pick'] for r in rs]):.2f}"
            if all("best_fixed_beta" in r for r in rs):
                cell += f"; best fixed β {np.mean([r['best_fixed_beta'] for r in rs]):.2f}"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--partitions-root", default="data/partitions")
    ap.add_argument("--out", help="write every row as JSON lines here (appended; rows already there are skipped)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", nargs="+", default=[], metavar="METHOD=N",
                    help="another round budget for a method (its rows are labelled 'METHOD (N rounds)')")
    ap.add_argument("--no-beta-grid", dest="grid", action="store_false",
                    help="skip FLIS-DC's fixed-β grid (5 more runs per structured cell)")
    args = ap.parse_args()
    try:
        rounds = {m: int(n) for m, n in (item.split("=", 1) for item in args.rounds)}
    except ValueError:
        print(f"auto_clusters: error: --rounds takes METHOD=N (an integer), e.g. cfl=40; got {args.rounds}",
              file=sys.stderr)
        return 2
    if set(rounds) - set(METHODS):
        print(f"auto_clusters: error: --rounds names unknown methods {sorted(set(rounds) - set(METHODS))}; "
              f"choose from {list(METHODS)}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    from flockfl.errors import ConfigError

    done = []
    if args.out and Path(args.out).exists():
        done = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    have = {(r["method"], r["partition"], r["seed"]) for r in done}
    label = {m: m if m not in rounds else f"{m} ({rounds[m]} rounds)" for m in args.methods}
    rows = [r for r in done if r["method"] in label.values() and r["partition"] in args.partitions
            and r["seed"] < args.seeds]
    for s in range(args.seeds):  # seed by seed: a partial run still covers every cell
        for p in args.partitions:
            for m in args.methods:
                if (label[m], p, s) in have:
                    continue
                try:
                    r = one(m, p, s, args.params, args.partitions_root, rounds.get(m), args.grid)
                except ConfigError as err:
                    print(f"auto_clusters: error: {err}", file=sys.stderr)
                    return 2
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
    budget = "; ".join(f"{m}: {rounds.get(m, METHODS[m][1])} rounds × {METHODS[m][2]} local epochs" for m in args.methods)
    print(f"\n### Clusters chosen by `auto` ({args.seeds} seeds; mean ARI, its minimum, k per seed)\n")
    print(f"30 clients, all training every round, MLP(64), batch 10, lr 0.1; budget: {budget}\n")
    print(report(rows, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
