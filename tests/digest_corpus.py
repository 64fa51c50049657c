"""A fixed corpus of short runs and their ``state_sha256``: the bit-for-bit behaviour that a
restructuring must keep (``tests/test_digests.py`` checks it; ``python tests/digest_corpus.py
--write`` records it anew, which only a deliberate change of behaviour may do). Bits depend on the
CPU's kernels, so tests/digests.json keeps one recording per machine arithmetic (:func:`arithmetic`)
and holds a machine without one to the first; a deliberate change is recorded on each machine kind.

Every algorithm (and the variant families that switch code paths), both trainers, each stage
(curriculum, pruning, shift, newcomers), a resume in the middle of a run, and the Prefect flow
and the Dask executor through ``flockfl run``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIGESTS = HERE / "digests.json"
# the recording made before the corpus was kept per machine (its CPU's fingerprint was not taken):
# what a machine without a recording of its own is held to
FIRST = "first"


def arithmetic() -> str:
    """A fingerprint of this CPU's float32 arithmetic as the runs meet it: a GEMM, a batched GEMM, a
    convolution, a softmax and a reduction on fixed inputs. The same code ends in other bits on
    another CPU (AVX-512/AMX and AVX2 kernels sum in other orders: 117 of the 119 digests differed
    between two machines of this workplace), so the corpus keeps one recording per fingerprint."""
    import hashlib

    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 64, generator=g), torch.randn(64, 200, generator=g)
    x, w = torch.randn(5, 10, 64, generator=g), torch.randn(5, 64, 32, generator=g)
    img, k = torch.randn(4, 3, 12, 12, generator=g), torch.randn(6, 3, 5, 5, generator=g)
    outs = [a @ b, torch.bmm(x, w), torch.nn.functional.conv2d(img, k), torch.log_softmax(a @ b, -1), (a @ b).sum(0)]
    return hashlib.sha256(b"".join(o.contiguous().numpy().tobytes() for o in outs)).hexdigest()[:16]


def recordings() -> dict[str, dict[str, str]]:
    return json.loads(DIGESTS.read_text())


def recorded() -> dict[str, str]:
    """The digests recorded on a machine of this one's arithmetic, else the first recording."""
    rec = recordings()
    return rec.get(arithmetic(), rec[FIRST])

LINREG = {"dataset": {"name": "synthetic_linreg", "clusters": 2, "dim": 10, "samples_per_client": 40},
          "partition": {"scheme": "natural", "num_clients": 16}, "model": {"name": "linear"},
          "train": {"clients_per_round": 8, "full_batch": True, "lr": 0.05}}
K2 = {"k": 2}
# an MLP wide enough for low-rank layers (64→64: rank cap 32 ≥ 5 steps × 4), which the 16-unit default
# never reaches: FedAvg's mean on the factors, SCAFFOLD's correction beside them and its c_i⁺ read off them
LOWRANK = {"model": {"name": "mlp", "hidden": 64}, "train": {"batch_size": 4, "local_steps": 5}}

# name → config overrides of conftest.tiny_config (digits, 12 rotated clients, 3 rounds, MLP)
ALGORITHMS: dict[str, dict] = {
    "fedavg": {"algorithm": {"name": "fedavg"}},
    "fedsgd": {"algorithm": {"name": "fedsgd"}},
    "fedprox": {"algorithm": {"name": "fedprox"}},
    "fednova": {"algorithm": {"name": "fednova"}},
    "scaffold": {"algorithm": {"name": "scaffold"}},
    "scaffold_I": {"algorithm": {"name": "scaffold", "option": "I"}},
    "fedavg_lowrank": {**LOWRANK, "algorithm": {"name": "fedavg"}},
    "scaffold_lowrank": {**LOWRANK, "algorithm": {"name": "scaffold"}},
    "fedadam": {"algorithm": {"name": "fedadam"}},
    "fedadagrad": {"algorithm": {"name": "fedadagrad"}},
    "fedyogi": {"algorithm": {"name": "fedyogi"}},
    "fedavgm": {"algorithm": {"name": "fedavgm"}},
    "fedsplit": {"algorithm": {"name": "fedsplit"}},
    "fedsplit_exact": {**LINREG, "algorithm": {"name": "fedsplit", "prox": "exact"}},
    "fedeff": {"algorithm": {"name": "fedeff"}},
    "ccfl": {"algorithm": {"name": "ccfl"}, "train": {"local_steps": 4}},
    "pacfl": {"algorithm": {"name": "pacfl", "beta": 10.0}},
    "pacfl_beta": {"algorithm": {"name": "pacfl", "signature": "whole", "measure": "trace", "beta": 40.0}},
    "flis_dc": {"algorithm": {"name": "flis_dc", "server_data_size": 100, "beta": 0.5}},
    "flis_hc": {"algorithm": {"name": "flis_hc", "server_data_size": 100, "beta": 0.5}},
    "fedsc": {"algorithm": {"name": "fedsc"}},
    "local": {"algorithm": {"name": "local"}},
    "ifca": {"algorithm": {"name": "ifca", **K2}},
    "ifca_random_gradient": {"algorithm": {"name": "ifca", **K2, "init": "random", "option": "gradient"}},
    "ifca_linreg": {**LINREG, "algorithm": {"name": "ifca", **K2, "init": "random"}},
    "ifca_oneshot": {**LINREG, "algorithm": {"name": "ifca_oneshot", **K2}},
    "difca": {"algorithm": {"name": "difca", **K2}},
    "difca_reference_gi": {"algorithm": {"name": "difca", **K2, "dfca_variant": "reference_gi"}},
    "difca_reference_li": {"algorithm": {"name": "difca", **K2, "dfca_variant": "reference_li"}},
    "fedcluster": {"algorithm": {"name": "fedcluster"}},
    "fedac": {"algorithm": {"name": "fedac"}},
    "flexcfl": {"algorithm": {"name": "flexcfl"}},
    "fesem": {"algorithm": {"name": "fesem"}},
    "cfl-pacfl": {"algorithm": {"name": "cfl-pacfl", "eps1": 1e9, "eps2": 0.0, "warmup_rounds": 1}},
    "cfl": {"algorithm": {"name": "cfl", "warmup_rounds": 0, "eps1": 10.0, "eps2": 0.0}},
    "fedper": {"algorithm": {"name": "fedper"}},
    "lg_fedavg": {"algorithm": {"name": "lg_fedavg", "global_layers": "top:1"}},
    "fedrep": {"algorithm": {"name": "fedrep", "head_epochs": 1}},
    "fedbabu": {"algorithm": {"name": "fedbabu", "finetune_epochs": 1}},
    "fedbn": {"model": {"name": "lenet5_bn"}, "algorithm": {"name": "fedbn"}},
    "ditto": {"algorithm": {"name": "ditto"}},
    "apfl": {"algorithm": {"name": "apfl"}},
    "perfedavg": {"algorithm": {"name": "perfedavg", "variant": "hf"}},
    "pfedme": {"algorithm": {"name": "pfedme"}},
}

STAGES: dict[str, dict] = {
    "curriculum_data": {"curriculum": {"ordering": "curr", "scoring": "s_G"}},
    "curriculum_clients": {"curriculum": {"ordering": "anti", "scoring": "s_L", "clients": True}},
    "pruning_unstructured": {"pruning": {"method": "unstructured", "acc_threshold": 0.0}},
    "pruning_hybrid_ifca": {"model": {"name": "lenet5_bn"}, "algorithm": {"name": "ifca", **K2},
                            "pruning": {"method": "hybrid", "acc_threshold": 0.0}},
    "shift_swap_all": {"shift": {"kind": "swap_all", "probability": 0.5}},
    # stages act once per round, not per cycle: one shift per round, the client curriculum's cohort split by the cycles
    "fedcluster_shift_curriculum": {"algorithm": {"name": "fedcluster", "k": 2}, "shift": {"kind": "swap_all", "probability": 0.5},
                                    "curriculum": {"clients": True, "ordering": "curr", "b": 0.5}},
    "shift_incremental_flexcfl": {"algorithm": {"name": "flexcfl"}, "shift": {"kind": "incremental", "every": 1, "release": 0.5}},
    "newcomers_pacfl": {"partition": {"unseen_fraction": 0.25}, "train": {"clients_per_round": 6},
                        "algorithm": {"name": "pacfl", "measure": "smallest_angle", "cut": "largest_gap"}},
    "newcomers_fedavg_every": {"partition": {"unseen_fraction": 0.25}, "train": {"eval_finetune": "every"}},
}

# resumed after round 2 of 4 from a checkpoint, in a fresh context
RESUME = ["fedavg", "scaffold", "ifca", "fedcluster", "fedac", "flexcfl", "curriculum_clients", "pruning_unstructured",
          "shift_swap_all", "cfl", "fedrep", "ditto", "apfl", "fedcluster_shift_curriculum"]


def cases() -> dict[str, dict]:
    """Every plain case: name → raw config (before validation)."""
    from conftest import tiny_config
    from flockfl.config import deep_merge

    out = {}
    for name, over in {**ALGORITHMS, **STAGES}.items():
        for engine in ("vectorized", "reference"):
            out[f"{name}/{engine}"] = tiny_config(**deep_merge(over, {"train": {"engine": engine}}))
    for name in RESUME:
        over = {**ALGORITHMS, **STAGES}[name]
        out[f"{name}/resume"] = tiny_config(**deep_merge(over, {"train": {"rounds": 4, "engine": "vectorized"}}))
    return out


def run_case(name: str, raw: dict, root: Path) -> str:
    """The final state's digest of one case (a resume case: the resumed run's, after checking
    that it equals the uninterrupted run's)."""
    from flockfl.experiments import validate
    from flockfl.rounds import PLAIN, drive, prepare, run_rounds
    from flockfl.state import load_latest, save_checkpoint

    cfg = validate(raw)
    if not name.endswith("/resume"):
        return run_rounds(prepare(cfg, root / "partitions")).digest()
    full = run_rounds(prepare(cfg, root / "partitions"))
    half = run_rounds(prepare(cfg, root / "partitions"), until=2)
    save_checkpoint(half, root / name.replace("/", "_"))
    restored, _ = load_latest(root / name.replace("/", "_"))
    resumed = drive(prepare(cfg, root / "partitions"), restored, PLAIN)
    assert resumed.digest() == full.digest(), f"{name}: the resumed run differs from the uninterrupted one"
    return resumed.digest()


# through the real `flockfl run` process (the Prefect flow; the Dask executor on a LocalCluster)
FLOCK_RUNS: dict[str, dict] = {
    "flow/ifca": {"algorithm": {"name": "ifca", **K2}, "train": {"shard_size": 4}},
    "dask/scaffold": {"algorithm": {"name": "scaffold"}, "train": {"shard_size": 2, "threads": 1},
                      "executor": {"kind": "dask", "workers": 2}},
    "dask/ditto": {"algorithm": {"name": "ditto"}, "train": {"shard_size": 2, "threads": 1},
                   "executor": {"kind": "dask", "workers": 2}},
}


def run_flock_case(name: str, root: Path) -> str:
    import yaml

    from conftest import last_json, run_flock, tiny_config

    d = root / name.replace("/", "_")
    d.mkdir(parents=True, exist_ok=True)
    (d / "exp.yaml").write_text(yaml.safe_dump(tiny_config(**FLOCK_RUNS[name])))
    res = run_flock(["run", "exp.yaml", "--json"], d)
    assert res.returncode == 0, res.stderr[-3000:]
    return last_json(res.stdout)["state_sha256"]


def write_all(root: Path) -> dict[str, str]:
    """Record this machine's digests (its fingerprint's entry; the others are kept): every case,
    the flows, and the older behaviours some tests hold a key's setting to (``EXTRA``)."""
    out = {name: run_case(name, raw, root) for name, raw in cases().items()}
    out.update({name: run_flock_case(name, root) for name in FLOCK_RUNS})
    out.update({name: run_case(name.split("@")[0], extra_config(name), root) for name in EXTRA})
    rec = recordings() if DIGESTS.exists() else {}
    rec[arithmetic()] = dict(sorted(out.items()))
    DIGESTS.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return out


# behaviours of before a key was added that its old setting must keep (name@what: the case, and its
# config's overrides), checked by tests/test_baseline_keys_*.py
EXTRA: dict[str, dict] = {
    "pfedme/reference@before_train_all_clients": {"algorithm": {"name": "pfedme", "train_all_clients": False,
                                                                "inner_l2": 0.0, "local_rounds": None},
                                                  "train": {"engine": "reference"}},
    "pfedme/vectorized@before_train_all_clients": {"algorithm": {"name": "pfedme", "train_all_clients": False,
                                                                 "inner_l2": 0.0, "local_rounds": None},
                                                   "train": {"engine": "vectorized"}},
    "lg_fedavg/vectorized@refresh_global_at_eval": {"algorithm": {"refresh_global_at_eval": True}},
}


def extra_config(name: str) -> dict:
    from flockfl.config import deep_merge

    return deep_merge(cases()[name.split("@")[0]], EXTRA[name])


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(HERE))
    import conftest  # noqa: F401  (threads, Prefect home)

    if "--write" not in sys.argv:
        sys.exit("usage: python tests/digest_corpus.py --write   (records tests/digests.json anew)")
    with tempfile.TemporaryDirectory() as d:
        for k, v in write_all(Path(d)).items():
            print(k, v)
