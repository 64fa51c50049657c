"""FedCluster against FedAvg at equal device work on heterogeneous least squares (spec §3.1,
sanity test 4; §4.4 data).

Every round FedAvg trains K clients once and makes one global update; FedCluster(M) trains K/M
clients in each of its M cycles (K clients a round, each once) and makes M updates. The table
prints ‖x − x*‖/‖x*‖ after R rounds for each M (M = 1 is FedAvg, state digest included).

    python benchmarks/fedcluster_lsq.py [--rounds 40] [--epochs 5] [--clients 20]
"""

from __future__ import annotations

import argparse

from flockfl.data.lsq import hetero_lsq, lsq_config, rel_error
from flockfl.experiments import validate
from flockfl.rounds import prepare_data, run_rounds


def lsq_run(algo: dict, data, train: dict):
    return prepare_data(validate(lsq_config(algo, data.num_clients, train)), data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=5, help="local full-batch steps per client")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 5, 10])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    print(f"heterogeneous least squares: m={args.clients}, d=20, n=50; K={args.clients} clients per round, "
          f"E={args.epochs} full-batch steps, lr = 0.2/L; {args.rounds} rounds; rel. error ‖x − x*‖/‖x*‖ (lower is better)")
    header = f"{'method':<18}" + "".join(f"{'seed ' + str(s):>12}" for s in args.seeds) + f"{'updates/round':>15}"
    print(header)
    print("-" * len(header))
    digests = {}
    for m in args.ms:
        errs = []
        for seed in args.seeds:
            data, x_star, lam = hetero_lsq(m=args.clients, seed=seed)
            algo = {"name": "fedavg"} if m == 0 else {"name": "fedcluster", "k": m}
            state = run_rounds(lsq_run(algo, data, {"lr": 0.2 / lam, "local_epochs": args.epochs, "rounds": args.rounds}))
            errs.append(rel_error(state, x_star))
            digests[(m, seed)] = state.digest()
        print(f"{'FedCluster M=' + str(m):<18}" + "".join(f"{e:>12.4f}" for e in errs) + f"{m:>15}")
    for seed in args.seeds:
        data, x_star, lam = hetero_lsq(m=args.clients, seed=seed)
        fedavg = run_rounds(lsq_run({"name": "fedavg"}, data, {"lr": 0.2 / lam, "local_epochs": args.epochs, "rounds": args.rounds}))
        if 1 in args.ms:
            same = fedavg.digest() == digests[(1, seed)]
            print(f"seed {seed}: FedAvg rel. error {rel_error(fedavg, x_star):.4f}; FedCluster(M=1) state digest "
                  f"{'equals' if same else 'DIFFERS FROM'} FedAvg's")


if __name__ == "__main__":
    main()
