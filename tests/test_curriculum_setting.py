"""The curriculum chapter's setting in lockstep with its Algorithm 1 (thesis seed 001, Chapter 2;
spec curriculum-and-pruning.md §1.4, §1.10), vanilla ordering (no curriculum).

Algorithm 1 as the thesis prints it, written out in plain PyTorch: each round K of the M clients
at random; each trains from the broadcast model for n_epoch epochs of batch-size-10 minibatches
(a budget of E·⌈n/B⌉ steps, so a client's steps follow its size) with SGD, momentum 0.9, weight
decay 5e-4 and the rate η₀(1 + α·i)^−b at local step i, the step count reset every round (§2.8:
a fresh ``torch.optim.SGD`` and ``LambdaLR`` per client per round); the server takes
θ_g ← Σ_m |D_m|/Σ_i |D_i| · θ_m over the cohort. The metric: the global model on the whole test set.

flockfl runs the same setting (FedAvg, ``train.lr_schedule=inverse``, ``train.momentum``,
``train.weight_decay``) on the same Dir(0.05) partition, initial model, cohorts and batch orders
(each epoch's shuffle from flockfl's (seed, round, client, "shuffle") stream); its global model
must agree after every round, for both trainers, in float64.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flockfl.experiments import validate
from flockfl.rng import np_rng
from flockfl.rounds import prepare, run_rounds

from conftest import flockfl_run
from test_niid_lockstep import fmnist_files, max_diff, read_idx, to_tensor

ENGINES = ("reference", "vectorized")
TOL_64 = 1e-7  # flockfl's aggregation weights are float32 (~1e-8 relative)
# the brief's setting (spec §1.10 with an MLP and lr 0.01); α = 0.01 instead of 0.001 so that the
# decay is visible within these short local passes (test_the_lockstep_sees_each_rule)
HP = {"lr": 0.01, "rho": 0.9, "wd": 5e-4, "alpha": 0.01, "b": 0.75, "batch": 10, "epochs": 2, "hidden": 200}


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def client_update(net: nn.Module, x, y, perms: list[np.ndarray], hp: dict) -> None:
    """ClientUpdate of Algorithm 1 with the vanilla order: E epochs of shuffled minibatches
    (the last one partial), SGD with momentum and weight decay, η₀(1 + α·i)^−b at step i."""
    opt = torch.optim.SGD(net.parameters(), lr=hp["lr"], momentum=hp["rho"], weight_decay=hp["wd"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (1.0 + hp["alpha"] * i) ** -hp["b"])
    criterion = nn.CrossEntropyLoss()
    for perm in perms:
        for a in range(0, len(y), hp["batch"]):
            idx = torch.from_numpy(perm[a: a + hp["batch"]])
            opt.zero_grad()
            criterion(net(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()


def algorithm1(init: dict, train: list, test: tuple, cohorts: list, hp: dict, seed: int, dtype) -> tuple[list, list]:
    """The server loop: the global state_dict and the whole-test-set accuracy after each round."""
    d = train[0][0][0].numel()
    glob = MLP(d, hp["hidden"]).to(dtype)
    glob.load_state_dict(init)
    out, accs = [], []
    for r, cohort in enumerate(cohorts):
        models, sizes = [], []
        for m in cohort:
            net = copy.deepcopy(glob)
            x, y = train[m]
            rng = np_rng(seed, r, int(m), "shuffle")
            client_update(net, x, y, [rng.permutation(len(y)) for _ in range(hp["epochs"])], hp)
            models.append(net.state_dict())
            sizes.append(len(y))
        total = sum(sizes)
        glob.load_state_dict({k: sum(s / total * sd[k] for s, sd in zip(sizes, models)) for k in models[0]})
        out.append(copy.deepcopy(glob.state_dict()))
        with torch.no_grad():
            accs.append(float((glob(test[0]).argmax(1) == test[1]).double().mean()))
    return out, accs


def config(engine: str, npz: Path, hp: dict, seed: int, clients: int, per_round: int, rounds: int, alpha: float) -> dict:
    return {"name": "algorithm1", "seed": seed, "dataset": {"name": "npz", "path": str(npz)},
            "partition": {"scheme": "dirichlet", "alpha": alpha, "num_clients": clients},
            "model": {"name": "mlp", "hidden": hp["hidden"]}, "algorithm": {"name": "fedavg"},
            "train": {"rounds": rounds, "clients_per_round": per_round, "local_epochs": hp["epochs"],
                      "batch_size": hp["batch"], "lr": hp["lr"], "momentum": hp["rho"], "weight_decay": hp["wd"],
                      "lr_schedule": "inverse", "lr_alpha": hp["alpha"], "lr_b": hp["b"], "eval_every": 1,
                      "eval_finetune": "off", "engine": engine, "threads": 1},
            "eval": {"test_set": "proportional", "average": "samples", "report": "final"},
            "tracking": {"enabled": False}}


def fmnist_slice(tmp: Path, n_train: int, n_test: int) -> tuple[Path, dict]:
    files = fmnist_files()
    raw = {k: read_idx(v) for k, v in files.items()}
    arrays = {"x_train": to_tensor(raw["x_train"][:n_train]), "y_train": torch.from_numpy(raw["y_train"][:n_train].astype(np.int64)),
              "x_test": to_tensor(raw["x_test"][:n_test]), "y_test": torch.from_numpy(raw["y_test"][:n_test].astype(np.int64))}
    path = tmp / "fmnist_slice.npz"
    np.savez(path, **{k: v.numpy() for k, v in arrays.items()})
    return path, arrays


def lockstep(engine: str, tmp: Path, hp: dict = HP, seed: int = 0, clients: int = 20, per_round: int = 5,
             rounds: int = 3, alpha: float = 0.05, dtype=torch.float64):
    npz, arrays = fmnist_slice(tmp, 1200, 300)
    prep, init, after, accs, cohorts = flockfl_run(config(engine, npz, hp, seed, clients, per_round, rounds, alpha),
                                                   tmp / "parts", dtype)
    data = prep.ctx.data
    from flockfl.data.datasets import load_dataset
    from flockfl.data.schemes import make_partition

    part = make_partition(load_dataset(prep.cfg.dataset, seed, clients), prep.cfg)
    x_tr = arrays["x_train"].to(dtype)
    train = [(x_tr[idx], arrays["y_train"][idx]) for idx in map(torch.from_numpy, part.train_idx)]
    names = {"1": "fc1", "3": "fc2"}  # flockfl's mlp: Sequential(Flatten, Linear, ReLU, Linear)
    ref_names = lambda p: {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in p.items()}  # noqa: E731
    ref, accs = algorithm1(ref_names(init), train, (arrays["x_test"].to(dtype), arrays["y_test"]), cohorts, hp, seed, dtype)
    mine = [ref_names(a) for a in after]
    return {"diffs": [max_diff(a, r) for a, r in zip(mine, ref)], "accs": accs,
            "ref_accs": accs, "ref": ref, "init": ref_names(init), "sizes": data.train.sizes, "cohorts": cohorts,
            "covered": np.sort(np.concatenate(part.test_idx)), "n_test": len(arrays["y_test"])}


@pytest.mark.parametrize("engine", ENGINES)
def test_fedavg_is_algorithm_1(engine, tmp_path):
    run = lockstep(engine, tmp_path)
    sizes = run["sizes"]
    assert sizes.max() > 5 * sizes.min()  # Dir(0.05): size skew, so the weights and step counts matter
    assert max_diff(run["init"], run["ref"][-1]) > 0.01
    assert max(run["diffs"]) < TOL_64, run["diffs"]
    np.testing.assert_array_equal(run["covered"], np.arange(run["n_test"]))  # the whole test set, once
    np.testing.assert_allclose(run["accs"], run["ref_accs"], atol=1e-12)


@pytest.mark.slow  # checks the lockstep test's own strength (11-17 s): the full suite's, not the fast tier's
def test_the_lockstep_sees_each_rule(tmp_path):
    """Each of Algorithm 1's choices moves the result far past the tolerance: a uniform server
    mean, a constant rate, no momentum, no weight decay."""
    base = lockstep("reference", tmp_path)
    for change in ({"alpha": 0.0}, {"rho": 0.0}, {"wd": 0.0}):
        other = algorithm1_only(tmp_path, {**HP, **change})
        assert max_diff(other, base["ref"][-1]) > 1e3 * TOL_64, change
    cfg = config("reference", tmp_path / "fmnist_slice.npz", HP, 0, 20, 5, 3, 0.05)
    cfg["algorithm"]["weighting"] = "uniform"
    prep = prepare(validate(cfg), tmp_path / "parts")
    prep.ctx.model.double()
    d = prep.ctx.data
    d.train.x, d.test.x = d.train.x.double(), d.test.x.double()
    d.pool.x = d.pool.x.double()
    uniform = run_rounds(prep).models
    assert max(float((uniform[k][0] - v).abs().max()) for k, v in flockfl_names(base["ref"][-1]).items()) > 1e3 * TOL_64


def flockfl_names(p: dict) -> dict:
    names = {"fc1": "1", "fc2": "3"}
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in p.items()}


def algorithm1_only(tmp: Path, hp: dict) -> dict:
    """Algorithm 1's final model under ``hp`` on the lockstep's partition and cohorts."""
    run = lockstep("reference", tmp, hp=hp)
    return run["ref"][-1]
