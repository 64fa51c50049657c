"""Lockstep against NIID-Bench's own loop (Xtra-Computing/NIID-Bench ``experiments.py``).

NIID-Bench's FedAvg, FedProx, SCAFFOLD and FedNova are written out here as its code runs them,
in plain PyTorch: per client a fresh ``torch.optim.SGD(lr, momentum=rho, weight_decay=reg)``
(its ``--rho 0.9``, ``--reg 1e-5``), ``CrossEntropyLoss``, a shuffled ``DataLoader`` with the
last partial batch kept, and

- FedProx: ``(mu/2)·‖w − w_g‖²`` added to the loss (so μ(w − w_g) enters the gradient before
  the weight decay and the momentum buffer);
- SCAFFOLD (``train_net_scaffold``, ``local_train_net_scaffold`` and the ``alg == 'scaffold'``
  loop): after every optimiser step ``w ← w − lr·(c − c_i)`` (outside the momentum, l. 345-350),
  then ``c_i⁺ = c_i − c + (w_g − w)/(cnt·lr)`` with cnt the steps actually taken (l. 352, 364),
  ``c ← c + Σ_S (c_i⁺ − c_i)/N``: the unweighted sum over the cohort divided by all N parties
  (``total_delta /= args.n_parties``, l. 673-690), and the model mean weighted by n_i, as
  FedAvg's (``fed_avg_freqs``, l. 1025-1036). NIID-Bench starts c and every c_i at one fresh
  network's weights (l. 992-997), not at 0: the offset cancels exactly when every client trains
  every round (its ``--sample 1``, the table's 10 of 10), which
  ``test_scaffold_niid_bench_c_init_cancels_at_full_participation`` checks; the 3-of-4 lockstep
  below starts them at 0 (the SCAFFOLD paper's, flockfl's);
- FedNova: τ_i steps of momentum SGD, ``a_i = (τ − ρ(1 − ρ^τ)/(1 − ρ))/(1 − ρ)``,
  ``d_i = (w_g − w_i)/a_i``, ``w ← w_g − (Σ p_i a_i)·Σ p_i d_i`` with p_i = n_i/Σ_S n_j;
- FedAvg / FedProx: the mean of the client models weighted by n_i;
- evaluation: the global model's accuracy on the whole test set.

Both sides start from the same model (flockfl's round-0 parameters loaded into NIID-Bench's
``SimpleCNNMNIST``), train the same partition (the indices flockfl's Dirichlet scheme dealt,
read from the raw data here), the same cohorts and the same batch orders: a DataLoader's
shuffle draws a permutation per epoch, and the reference draws it from flockfl's own stream
(seed, round, client, "shuffle"), so the test checks the update rules, not the RNG. The global
parameters must agree after every round to float rounding, for both of flockfl's trainers.

flockfl runs the ``niid_bench`` setting as ``configs/repro/niid_bench_fmnist.yaml`` says: local
momentum 0.9 and weight decay 1e-5 for every method; FedNova's momentum as its own
``algorithm.momentum`` (normalised); SCAFFOLD with ``weighting: samples`` (NIID-Bench's and
Flower's model mean; the paper's is uniform, flockfl's default) and flockfl's control-variate
step (the unweighted cohort sum over N: NIID-Bench's; Flower's baseline weights it by n_i).
"""

from __future__ import annotations

import copy
import gzip
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F

from flockfl.rng import np_rng

from conftest import flockfl_run

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
METHODS = ("fedavg", "fedprox", "scaffold", "fednova")
ENGINES = ("reference", "vectorized")
TOL = 1e-5  # float32
TOL_64 = 1e-7  # float64 (flockfl's aggregation weights are float32: ~1e-8 relative, so |Δθ| ~1e-8)


# ---------------------------------------------------------------------- NIID-Bench's side


class SimpleCNNMNIST(nn.Module):
    """NIID-Bench ``model.py`` SimpleCNNMNIST(input_dim=16·4·4, hidden_dims=[120, 84]), its
    Fashion-MNIST CNN; ``kernel``/``padding``/``flat`` give the same network on 8×8 digits."""

    def __init__(self, kernel: int = 5, padding: int = 0, flat: int = 16 * 4 * 4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel, padding=padding)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, kernel, padding=padding)
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)
        self.flat = flat

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, self.flat)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def loader(x: torch.Tensor, y: torch.Tensor, batch: int, epoch_perms: list[np.ndarray]):
    """``DataLoader(shuffle=True, drop_last=False)`` over one epoch per permutation."""
    for perm in epoch_perms:
        for a in range(0, len(y), batch):
            idx = torch.from_numpy(perm[a: a + batch])
            yield x[idx], y[idx]


def flockfl_perms(seed: int, round: int, client: int, n: int, epochs: int) -> list[np.ndarray]:
    """The shuffle of each epoch, drawn from flockfl's (seed, round, client, "shuffle") stream."""
    rng = np_rng(seed, round, client, "shuffle")
    return [rng.permutation(n) for _ in range(epochs)]


def nb_train(alg: str, net: nn.Module, global_net: nn.Module, batches, hp: dict, c_global=None, c_local=None):
    """One client's local training (``train_net``, ``train_net_fedprox``, ``train_net_scaffold``,
    ``train_net_fednova``). Returns the step count (``cnt`` / ``tau``)."""
    opt = torch.optim.SGD(net.parameters(), lr=hp["lr"], momentum=hp["rho"], weight_decay=hp["reg"])
    criterion = nn.CrossEntropyLoss()
    global_weights = list(global_net.parameters())
    cnt = 0
    for x, target in batches:
        opt.zero_grad()
        loss = criterion(net(x), target.long())
        if alg == "fedprox":
            reg = 0.0
            for i, param in enumerate(net.parameters()):
                reg += (hp["mu"] / 2) * torch.norm(param - global_weights[i]) ** 2
            loss = loss + reg
        loss.backward()
        opt.step()
        if alg == "scaffold":
            para = net.state_dict()
            for key in para:
                para[key] = para[key] - hp["lr"] * (c_global[key] - c_local[key])
            net.load_state_dict(para)
        cnt += 1
    return cnt


def nb_accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


# SCAFFOLD's server step as NIID-Bench's experiments.py runs it; ``nb_run(scaffold=...)`` swaps one
# rule so that test_the_lockstep_sees_each_rule can show the tolerance sees it:
# - c_init: "zero" (the paper's, flockfl's) or "net" (NIID-Bench's: c and every c_i start at one fresh
#   network's weights, init_nets + load_state_dict, l. 992-997);
# - c_divisor: "N" (NIID-Bench's total_delta /= args.n_parties, l. 679-680; the paper's (|S|/N)·mean)
#   or "S" (the cohort's plain mean);
# - c_mean: "uniform" (NIID-Bench's) or "samples" (Flower's baselines/niid_bench: strategy.py:128
#   aggregate() weights Δc_i by num_examples, server_scaffold.py:142-147 scales by |S|/N);
# - K: "steps" (NIID-Bench's cnt, the steps taken; Flower's num_epochs·len(trainloader), the same) or
#   "floor" (epochs·⌊n_i/B⌋, as if the last partial batch were dropped).
SCAFFOLD_RULE = {"c_init": "zero", "c_divisor": "N", "c_mean": "uniform", "K": "steps"}


def nb_run(alg: str, init: dict, data: dict, schedule: list[np.ndarray], hp: dict, seed: int, model_args: dict,
           dtype: torch.dtype, scaffold: dict | None = None):
    """NIID-Bench's server loop over ``len(schedule)`` rounds (cohorts given); the global
    state_dict after each round and the global test accuracy. ``scaffold`` overrides
    :data:`SCAFFOLD_RULE`."""
    rule = {**SCAFFOLD_RULE, **(scaffold or {})}
    n_parties = len(data["train"])
    global_net = SimpleCNNMNIST(**model_args).to(dtype)
    global_net.load_state_dict(init)
    zero = {k: torch.zeros_like(v) for k, v in global_net.state_dict().items()}
    if rule["c_init"] == "net":  # c_globals, _, _ = init_nets(...); every c_net loads c_global's weights
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            zero = {k: v.detach().clone() for k, v in SimpleCNNMNIST(**model_args).to(dtype).state_dict().items()}
        assert max(float(v.abs().max()) for v in zero.values()) > 0.1
    c_global = copy.deepcopy(zero)
    c_nets = [copy.deepcopy(zero) for _ in range(n_parties)]
    sizes = [len(y) for _, y in data["train"]]
    out, accs = [], []
    for r, selected in enumerate(schedule):
        global_para = copy.deepcopy(global_net.state_dict())
        nets, counts, c_deltas = {}, {}, {}
        a_list, d_list = [], []
        for cid in sorted(int(c) for c in selected):  # NIID-Bench walks nets.items() in id order
            net = SimpleCNNMNIST(**model_args).to(dtype)
            net.load_state_dict(global_para)
            x, y = data["train"][cid]
            batches = loader(x, y, hp["batch"], flockfl_perms(seed, r, cid, len(y), hp["epochs"]))
            if alg == "scaffold":
                c_local = c_nets[cid]
                cnt = nb_train(alg, net, global_net, batches, hp, c_global, c_local)
                k_steps = cnt if rule["K"] == "steps" else hp["epochs"] * (len(y) // hp["batch"])
                net_para = net.state_dict()
                c_new = {k: c_local[k] - c_global[k] + (global_para[k] - net_para[k]) / (k_steps * hp["lr"])
                         for k in net_para}
                c_deltas[cid] = {k: c_new[k] - c_local[k] for k in c_new}
                c_nets[cid] = c_new
            else:
                cnt = nb_train(alg, net, global_net, batches, hp)
            if alg == "fednova":
                rho = hp["rho"]
                a_i = (cnt - rho * (1 - pow(rho, cnt)) / (1 - rho)) / (1 - rho)
                net_para = net.state_dict()
                a_list.append(a_i)
                d_list.append({k: torch.true_divide(global_para[k] - net_para[k], a_i) for k in net_para})
            nets[cid], counts[cid] = net, cnt
        order = [int(c) for c in selected]
        total = sum(sizes[c] for c in order)
        if alg == "fednova":
            d_total = {k: 0.0 for k in global_para}
            for i, c in enumerate(sorted(order)):
                for k in d_total:
                    d_total[k] += d_list[i][k] * sizes[c] / total
            coeff = sum(a_list[i] * sizes[c] / total for i, c in enumerate(sorted(order)))
            new = {k: global_para[k] - coeff * d_total[k] for k in global_para}
        else:
            new = {}
            for i, c in enumerate(order):
                para = nets[c].state_dict()
                for k in para:
                    new[k] = para[k] * (sizes[c] / total) if i == 0 else new[k] + para[k] * (sizes[c] / total)
        if alg == "scaffold":
            if rule["c_mean"] == "uniform":  # total_delta = Σ_S Δc_i, then /= args.n_parties
                divisor = n_parties if rule["c_divisor"] == "N" else len(order)
                total_delta = {k: sum(c_deltas[c][k] for c in sorted(order)) / divisor for k in c_global}
            else:  # Flower: (|S|/N)·Σ_S (n_i/Σ_S n_j) Δc_i
                total_delta = {k: (len(order) / n_parties) * sum(c_deltas[c][k] * sizes[c] / total for c in order)
                               for k in c_global}
            c_global = {k: c_global[k] + total_delta[k] for k in c_global}
        global_net.load_state_dict(new)
        out.append(copy.deepcopy(global_net.state_dict()))
        accs.append(nb_accuracy(global_net, *data["test"]))
    return out, accs


# ---------------------------------------------------------------------- the data


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """torchvision's ``ToTensor`` on uint8 greyscale images: N×1×H×W float32 in [0, 1]."""
    return torch.from_numpy(images.copy()).unsqueeze(1).to(torch.float32).div(255)


def fmnist_files() -> dict[str, Path]:
    names = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
    out = {}
    for key, stem in names.items():
        f = FMNIST / stem
        out[key] = f if f.exists() else FMNIST / (stem + ".gz")
        if not out[key].exists():
            pytest.skip(f"Fashion-MNIST is not installed in {FMNIST} (apt-get install dataset-fashion-mnist)")
    return out


def tiny_slice(kind: str, tmp: Path, n_train: int = 240, n_test: int = 200) -> tuple[Path, dict, dict]:
    """An npz of the first ``n_train``/``n_test`` samples (Fashion-MNIST from its raw IDX bytes,
    scaled as ToTensor does; or flockfl's digits), the arrays and the reference model's shape."""
    if kind == "fmnist":
        files = fmnist_files()
        arrays = {k: read_idx(v) for k, v in files.items()}
        x_tr, x_te = to_tensor(arrays["x_train"][:n_train]), to_tensor(arrays["x_test"][:n_test])
        y_tr = torch.from_numpy(arrays["y_train"][:n_train].astype(np.int64))
        y_te = torch.from_numpy(arrays["y_test"][:n_test].astype(np.int64))
        model_args = {}
    else:
        from flockfl.config import DatasetConfig
        from flockfl.data.datasets import load_dataset

        ds = load_dataset(DatasetConfig(name="digits"), 0, None)
        x_tr, y_tr, x_te, y_te = (torch.from_numpy(a[:n]).clone(memory_format=torch.contiguous_format) for a, n in (
            (ds.x_train, n_train), (ds.y_train, n_train), (ds.x_test, n_test), (ds.y_test, n_test)))
        model_args = {"kernel": 3, "padding": 1, "flat": 16 * 2 * 2}  # flockfl's lenet5 on 8×8
    path = tmp / f"{kind}.npz"
    np.savez(path, x_train=x_tr.numpy(), y_train=y_tr.numpy(), x_test=x_te.numpy(), y_test=y_te.numpy())
    return path, {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}, model_args


# ---------------------------------------------------------------------- flockfl's side


def repro_rows() -> dict:
    return yaml.safe_load((ROOT / "configs/repro/niid_bench_fmnist.yaml").read_text())


def flockfl_config(alg: str, engine: str, npz: Path, hp: dict, seed: int, clients: int, per_round: int,
                   rounds: int) -> dict:
    """The repro table's row for ``alg`` (its algorithm keys and train overrides) on the base
    setting, shrunk: the tiny npz, ``clients`` Dir(0.5) clients, ``rounds`` rounds."""
    table = repro_rows()
    row = next(r for r in table["rows"].values() if r["algorithm"]["name"] == alg)
    base = table["base"]["train"]
    assert (base["momentum"], base["weight_decay"], base["lr"]) == (0.9, 1e-5, 0.01)  # NIID-Bench's rho, reg, lr
    algorithm = dict(row["algorithm"])
    if "mu" in algorithm:
        algorithm["mu"] = hp["mu"]
    train = {"rounds": rounds, "clients_per_round": per_round, "local_epochs": hp["epochs"], "batch_size": hp["batch"],
             "lr": hp["lr"], "momentum": hp["rho"], "weight_decay": hp["reg"], "eval_finetune": "off",
             "eval_every": 1, "engine": engine, "threads": 1, **{k: v for k, v in row.get("train", {}).items() if k != "momentum"}}
    if "momentum" in row.get("train", {}):  # FedNova: its momentum is algorithm.momentum, train.momentum 0
        train["momentum"] = row["train"]["momentum"]
        if "momentum" in algorithm:
            algorithm["momentum"] = hp["rho"]
    return {"name": f"lockstep-{alg}", "seed": seed, "dataset": {"name": "npz", "path": str(npz)},
            "partition": {"scheme": "dirichlet", "alpha": 0.5, "num_clients": clients},
            "model": {"name": table["base"]["model"]["name"]}, "algorithm": algorithm, "train": train,
            "eval": dict(table["base"]["eval"]), "tracking": {"enabled": False}}


def to_reference(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """flockfl's ``lenet5`` (a Sequential: 0 conv, 3 conv, 7/9/11 linear) under NIID-Bench's names."""
    names = {"0": "conv1", "3": "conv2", "7": "fc1", "9": "fc2", "11": "fc3"}
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in params.items()}


# ---------------------------------------------------------------------- the tests

# NIID-Bench's rho and reg, batch 16 on ~60 samples a client; lr 0.05 (its 0.01 × 5), 5 local epochs and FedProx's
# mu = 0.1 (its grid: 0.001, 0.01, 0.1, 1) so that in 3 rounds the models learn and every rule moves them far
# past the tolerance (test_the_lockstep_sees_each_rule)
HP = {"lr": 0.05, "rho": 0.9, "reg": 1e-5, "mu": 0.1, "batch": 16, "epochs": 5}


class Lockstep(NamedTuple):
    diffs: list  # max |θ_flockfl − θ_NIID-Bench| after each round
    accs: list  # flockfl's accuracy after each round
    ref_accs: list  # NIID-Bench's global test accuracy after each round
    covered: np.ndarray  # the test rows the clients' proportional test sets hold, sorted
    n_test: int
    ref: list  # NIID-Bench's global state_dict after each round
    init: dict  # the round-0 model (flockfl's names)
    flockfl: list  # flockfl's global parameters after each round (NIID-Bench's names)


def lockstep(kind: str, alg: str, engine: str, tmp: Path, hp: dict = HP, dtype: torch.dtype = torch.float64,
             seed: int = 0, rounds: int = 3, clients: int = 4, per_round: int = 3, scaffold: dict | None = None,
             **algorithm) -> Lockstep:
    """Both loops on the same tiny Dir(0.5) setting; ``algorithm`` overrides flockfl's keys only,
    ``scaffold`` the reference's SCAFFOLD rules only (:data:`SCAFFOLD_RULE`)."""
    npz, arrays, model_args = tiny_slice(kind, tmp)
    cfg = flockfl_config(alg, engine, npz, hp, seed, clients, per_round, rounds)
    cfg["algorithm"].update(algorithm)
    prep, init, after, accs, cohorts = flockfl_run(cfg, tmp / "parts", dtype)
    from flockfl.data.datasets import load_dataset
    from flockfl.data.schemes import make_partition

    part = make_partition(load_dataset(prep.cfg.dataset, seed, clients), prep.cfg)
    x_tr, x_te = arrays["x_train"].to(dtype), arrays["x_test"].to(dtype)
    data = {"train": [(x_tr[idx], arrays["y_train"][idx]) for idx in map(torch.from_numpy, part.train_idx)],
            "test": (x_te, arrays["y_test"])}
    for cid, (x, y) in enumerate(data["train"]):  # the same samples, in the same local order
        fx, fy = prep.ctx.data.train.client(cid)
        assert torch.equal(fx, x) and torch.equal(fy, y)
    ref, ref_accs = nb_run(alg, to_reference(init), data, cohorts, hp, seed, model_args, dtype, scaffold)
    mine = [to_reference(f) for f in after]
    return Lockstep([max_diff(f, r) for f, r in zip(mine, ref)], accs, ref_accs, np.sort(np.concatenate(part.test_idx)),
                    len(arrays["y_test"]), ref, init, mine)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("alg", METHODS)
# the Fashion-MNIST cases (2.5-7 s each, 30 s in all) are the full suite's; the fast tier keeps the
# same methods and engines on digits (the same code paths, a smaller model input)
@pytest.mark.parametrize("kind", [pytest.param("fmnist", marks=pytest.mark.slow), "digits"])
def test_global_model_agrees_with_niid_bench_every_round(kind, alg, engine, tmp_path):
    """3 rounds, 3 of 4 clients a round (SCAFFOLD's c_i persist across a round sat out), 5
    local epochs of unequal client sizes (last partial batches), float64 on both sides."""
    run = lockstep(kind, alg, engine, tmp_path)
    assert max_diff(to_reference(run.init), run.ref[-1]) > 0.05  # the rounds really trained
    assert max(run.diffs) < TOL_64, f"{alg}/{engine}: max |Δθ| per round {run.diffs}"
    # evaluation: the proportional test sets cover the test set once, so the sample-weighted mean
    # over clients is the global model's accuracy on the whole test set, as NIID-Bench measures it
    np.testing.assert_array_equal(run.covered, np.arange(run.n_test))
    np.testing.assert_allclose(run.accs, run.ref_accs, atol=1e-12)


@pytest.mark.parametrize("alg", ["fedavg", "scaffold"])
def test_float32_as_flockfl_runs_agrees_to_rounding(alg, tmp_path):
    """float32, NIID-Bench's own lr 0.01 and mu 0.01, 2 rounds × 1 epoch: agreement to float32
    rounding. (Longer float32 runs may part by ~1e-4 after a step where a ReLU input lies within
    rounding of 0: a perturbation of 1e-7 of the initial model does the same to the reference
    loop itself, hence float64 above.)"""
    hp = {**HP, "lr": 0.01, "mu": 0.01, "epochs": 1}
    for engine in ENGINES:
        run = lockstep("digits", alg, engine, tmp_path, hp=hp, dtype=torch.float32, rounds=2)
        assert max(run.diffs) < TOL, f"{alg}/{engine}: {run.diffs}"


def test_scaffold_niid_bench_c_init_cancels_at_full_participation(tmp_path):
    """NIID-Bench starts c and every c_i at a fresh network's weights c₀ (experiments.py l. 992-997),
    not 0. With every client in every round (its ``--sample 1``; the table's 10 of 10) round 1 has
    c − c_i = 0 exactly and leaves c_i⁺ = (x − y_i)/(K·lr), c = mean_i c_i⁺: flockfl's zero start
    gives the same models. With 3 of 4 the offset lingers in c and in the clients not yet drawn."""
    for engine in ENGINES:
        full = lockstep("digits", "scaffold", engine, tmp_path, per_round=4, scaffold={"c_init": "net"})
        assert max(full.diffs) < TOL_64, f"{engine}: {full.diffs}"
    partial = lockstep("digits", "scaffold", "reference", tmp_path, scaffold={"c_init": "net"})
    assert max(partial.diffs) > 1e3 * TOL_64


@pytest.mark.slow  # checks the lockstep test's own strength (11-17 s): the full suite's, not the fast tier's
def test_the_lockstep_sees_each_rule(tmp_path):
    """The tolerance is far below what each rule changes: flockfl's SCAFFOLD with its default
    uniform model mean (the paper's) ends far from NIID-Bench's size-weighted one; a reference
    whose control-variate step divides by |S| instead of N, weights Δc_i by n_i (Flower's
    baseline) or counts K without the last partial batches ends far from flockfl's; and in
    NIID-Bench's own loop FedProx's proximal term, FedNova's normalisation, SCAFFOLD's
    correction and the weight decay each move the final model by far more than the tolerance."""
    uniform = lockstep("digits", "scaffold", "reference", tmp_path, weighting="uniform")
    assert max(uniform.diffs) > 1e3 * TOL_64
    for change in ({"c_divisor": "S"}, {"c_mean": "samples"}, {"K": "floor"}):
        other = lockstep("digits", "scaffold", "reference", tmp_path, scaffold=change)
        assert max(other.diffs) > 1e3 * TOL_64, change
    finals = {alg: lockstep("digits", alg, "reference", tmp_path).ref[-1] for alg in METHODS}
    for alg in ("fedprox", "scaffold", "fednova"):
        assert max_diff(finals[alg], finals["fedavg"]) > 1e3 * TOL_64, alg
    heavy = {**HP, "reg": 1e-3}  # NIID-Bench's 1e-5 moves these 3 short rounds by ~1e-7 only
    decayed = lockstep("digits", "fedavg", "vectorized", tmp_path, hp=heavy)
    assert max(decayed.diffs) < TOL_64
    assert max_diff(decayed.ref[-1], finals["fedavg"]) > 1e3 * TOL_64


def test_fashion_mnist_pixels_are_scaled_as_to_tensor():
    """flockfl's IDX loader gives NIID-Bench's inputs: ToTensor's x/255 in float32, no normalisation."""
    files = fmnist_files()
    from flockfl.config import DatasetConfig
    from flockfl.data.datasets import load_dataset

    ds = load_dataset(DatasetConfig(name="fashion_mnist", path=str(FMNIST)), 0, None)
    for split in ("train", "test"):
        raw = read_idx(files[f"x_{split}"])
        assert torch.equal(torch.from_numpy(getattr(ds, f"x_{split}")), to_tensor(raw))
        np.testing.assert_array_equal(getattr(ds, f"y_{split}"), read_idx(files[f"y_{split}"]).astype(np.int64))
