"""``train.optimizer_state``: the local optimiser's state (the heavy-ball momentum buffer) between a
client's rounds (issue 35).

``reset`` (the default, the papers'): a fresh optimiser every round, as before (the digest corpus,
tests/test_digests.py, holds those runs to their recorded bits). ``persist``: each client's buffer is
kept in ``state.algo['optimizer_state']`` (a ClientTable) and its next round starts from it, as the
codes that keep one ``torch.optim.SGD(momentum=ρ)`` per client do (CFL's notebook). Checked here:
that written-out loop in float64 (one optimiser per client, kept across rounds) in lockstep with
both trainers; the two trainers against each other; resume bit for bit, also mid-round; and the
one-line refusals where there is nothing to keep or a method's local update is not the trainers'
SGD step.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rng import np_rng
from flockfl.optimizer_state import OPTIMIZER_STATE
from flockfl.rounds import prepare, run_rounds

from conftest import (assert_mid_round_resume, assert_resume_bit_identical, assert_trainers_agree, flockfl_run, rel_err,
                      tiny_config)

ENGINES = ("reference", "vectorized")
TOL_64 = 1e-7  # flockfl's aggregation weights are float32 (~1e-8 relative)
# the lockstep's setting: 3 clients, every one of them every round, 3 rounds of one epoch
HP = {"lr": 0.05, "rho": 0.9, "batch": 32, "clients": 3, "rounds": 3, "seed": 5}


def persist(**train) -> dict:
    """The tiny digits run with local momentum 0.9 and ``train.optimizer_state=persist``."""
    return {"train": {"momentum": 0.9, "optimizer_state": "persist", "threads": 1, **train}}


# ---------------------------------------------------------------------- the default is unchanged


def test_reset_is_the_default_and_keeps_no_state(tmp_path):
    """The default is ``reset``: no table in the state, no buffer in any spec (memory only under persist);
    an explicit ``reset`` is the same run, bit for bit."""
    cfg = validate(tiny_config(train={"momentum": 0.9, "threads": 1}))
    assert cfg.train.optimizer_state == "reset"
    prep = prepare(cfg, tmp_path)
    specs = []
    select = prep.algorithm.local_spec
    prep.algorithm.local_spec = lambda *a: specs.append(select(*a)) or specs[-1]
    state = run_rounds(prep)
    assert OPTIMIZER_STATE not in state.algo and specs and all(s.momentum_init is None for s in specs)
    explicit = run_rounds(prepare(validate(tiny_config(train={"momentum": 0.9, "threads": 1, "optimizer_state": "reset"})),
                                  tmp_path))
    assert explicit.digest() == state.digest()


# ---------------------------------------------------------------------- lockstep with one SGD per client


def lockstep_config(engine: str, optimizer_state: str) -> dict:
    return tiny_config(seed=HP["seed"], partition={"scheme": "iid", "num_clients": HP["clients"]},
                       train={"rounds": HP["rounds"], "clients_per_round": HP["clients"], "local_epochs": 1,
                              "batch_size": HP["batch"], "lr": HP["lr"], "momentum": HP["rho"],
                              "optimizer_state": optimizer_state, "engine": engine, "eval_finetune": "off",
                              "threads": 1})


def sgd_per_client(prep, init: dict, keep: bool) -> list[dict]:
    """The codes' loop, written out: every client owns one ``torch.optim.SGD(momentum=ρ)`` for the whole
    run (``keep``; a fresh one each round otherwise); each round it loads the global model into its network
    (in place: the optimiser's state stays), takes one epoch of mini-batches in the order of flockfl's
    (seed, round, client, "shuffle") stream, and the server takes the n_i-weighted mean. Returns the
    global parameters after each round."""
    data, n = prep.ctx.data.train, HP["clients"]
    nets = [copy.deepcopy(prep.ctx.model).train() for _ in range(n)]
    opts = [torch.optim.SGD(net.parameters(), lr=HP["lr"], momentum=HP["rho"]) for net in nets]
    glob, out = {k: v.clone() for k, v in init.items()}, []
    for r in range(HP["rounds"]):
        models, sizes = [], []
        for c in range(n):
            if not keep:
                opts[c] = torch.optim.SGD(nets[c].parameters(), lr=HP["lr"], momentum=HP["rho"])
            nets[c].load_state_dict(glob)
            x, y = data.client(c)
            perm = np_rng(HP["seed"], r, c, "shuffle").permutation(len(y))
            for a in range(0, len(y), HP["batch"]):
                idx = torch.from_numpy(perm[a: a + HP["batch"]])
                opts[c].zero_grad()
                torch.nn.functional.cross_entropy(nets[c](x[idx]), y[idx]).backward()
                opts[c].step()
            models.append({k: v.detach().clone() for k, v in nets[c].state_dict().items()})
            sizes.append(len(y))
        glob = {k: sum(s / sum(sizes) * m[k] for s, m in zip(sizes, models)) for k in models[0]}
        out.append(glob)
    return out


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("engine", ENGINES)
def test_persist_is_one_sgd_per_client_kept_across_rounds(engine, tmp_path):
    """flockfl under ``persist`` follows the loop that keeps each client's SGD(momentum=0.9) across rounds,
    and under ``reset`` the loop that makes a fresh one every round, to float64 rounding after every round;
    the two settings agree in round 1 (a client's first round starts from a zero buffer either way) and part
    far beyond the tolerance from round 2 on (every client trains every round)."""
    runs = {}
    for mode in ("reset", "persist"):
        prep, init, after, _, cohorts = flockfl_run(lockstep_config(engine, mode), tmp_path / "parts", torch.float64)
        assert all(list(c) == list(range(HP["clients"])) for c in cohorts)
        runs[mode] = (prep, init, after)
    prep, init, _ = runs["persist"]
    for mode, keep in (("reset", False), ("persist", True)):
        ref = sgd_per_client(prep, init, keep)
        diffs = [max_diff(a, r) for a, r in zip(runs[mode][2], ref)]
        assert max(diffs) < TOL_64, (mode, diffs)
    reset, kept = runs["reset"][2], runs["persist"][2]
    assert all(torch.equal(reset[0][k], kept[0][k]) for k in kept[0])  # round 1: the same bits
    assert all(max_diff(a, b) > 1e3 * TOL_64 for a, b in zip(reset[1:], kept[1:])), [max_diff(a, b) for a, b in zip(reset, kept)]


# ---------------------------------------------------------------------- trainers, resume, distribution


def test_the_trainers_agree_under_persist(tmp_path):
    """6 of 12 clients a round for 3 rounds (some train twice, from their kept buffer): both trainers give
    the same models and the same kept buffers, every one of them written by a client's training."""
    ref, vec = assert_trainers_agree(lambda e: validate(tiny_config(**persist(engine=e))), tmp_path)
    a, b = ref.algo[OPTIMIZER_STATE], vec.algo[OPTIMIZER_STATE]
    np.testing.assert_array_equal(a.written(), b.written())
    trained = sorted({c for s in (ref, vec) for c in np.flatnonzero(s.algo[OPTIMIZER_STATE].written())})
    assert 6 < len(trained) < 12
    assert rel_err(b.gather(trained), a.gather(trained)) < 1e-5
    assert all(float(v.abs().sum(tuple(range(1, v.dim()))).min()) > 0 for v in a.gather(trained).values())


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_under_persist_is_bit_identical(engine, tmp_path):
    """Checkpoint after round 2, load, continue in a fresh context: the same bits as the straight run; the
    buffers travel in the checkpoint (row files under client_state/optimizer_state), and a resume that lost
    them (the clients restart from zero buffers) ends elsewhere."""
    from flockfl.rounds import PLAIN, drive
    from flockfl.state import load_latest

    cfg = validate(tiny_config(**persist(engine=engine, rounds=4)))
    full, _ = assert_resume_bit_identical(cfg, tmp_path, until=2)
    assert any((tmp_path / "run" / "client_state" / OPTIMIZER_STATE).rglob("*.row"))
    restored, _ = load_latest(tmp_path / "run")
    assert restored.algo[OPTIMIZER_STATE].written().sum() > 0
    restored.algo.pop(OPTIMIZER_STATE)
    assert drive(prepare(cfg, tmp_path), restored, PLAIN).digest() != full.digest()


def test_mid_round_resume_under_persist(tmp_path):
    """FedCluster's cycles: a cycle's clients start from the buffers the earlier cycles and rounds left, and a
    run resumed mid-round from a checkpoint ends as the straight run."""
    cfg = validate(tiny_config(algorithm={"name": "fedcluster", "k": 3}, **persist(rounds=3)))
    mid = assert_mid_round_resume(cfg, tmp_path, round=1, cycle=2)
    assert mid.algo[OPTIMIZER_STATE].written().sum() > 0


def test_shards_carry_their_clients_buffers_and_a_dropped_client_keeps_its_own(tmp_path):
    """Shards of 2 clients train as the whole cohort (each shard's buffers are its clients' rows); a client
    whose training fails every time is dropped from its rounds and its buffer is never written."""
    whole = run_rounds(prepare(validate(tiny_config(**persist())), tmp_path))
    sharded = run_rounds(prepare(validate(tiny_config(**persist(shard_size=2))), tmp_path))
    trained = np.flatnonzero(whole.algo[OPTIMIZER_STATE].written())
    np.testing.assert_array_equal(np.flatnonzero(sharded.algo[OPTIMIZER_STATE].written()), trained)
    assert rel_err(sharded.models, whole.models) < 1e-5
    assert rel_err(sharded.algo[OPTIMIZER_STATE].gather(trained), whole.algo[OPTIMIZER_STATE].gather(trained)) < 1e-5
    bad = int(trained[0])
    dropped = run_rounds(prepare(validate(tiny_config(**persist(shard_size=2, simulate_failures=[bad]))), tmp_path))
    written = dropped.algo[OPTIMIZER_STATE].written()
    assert not written[bad] and written[np.setdiff1d(trained, [bad])].all()


def test_the_buffers_travel_with_a_distributed_shard():
    """A Dask worker's shard moves the spec's per-client tensors to its device: the buffers too."""
    from flockfl.engine.schedule import LocalSpec
    from flockfl.executor import map_spec

    spec = LocalSpec(np.arange(2), {"w": torch.zeros(2, 3)}, 0.1, momentum=0.9, momentum_init={"w": torch.ones(2, 3)})
    moved = map_spec(spec, lambda t: t + 1)
    assert torch.equal(moved.momentum_init["w"], torch.full((2, 3), 2.0))


# ---------------------------------------------------------------------- refusals


REFUSED = [
    ({"train": {"optimizer_state": "persist"}}, "keeps nothing: the optimiser has no state (momentum 0, sgd)"),
    ({"algorithm": {"name": "apfl"}, **persist()}, "apfl's (v, α) loop"),
    ({"algorithm": {"name": "perfedavg"}, **persist()}, "perfedavg's meta-steps"),
    ({"algorithm": {"name": "ditto"}, **persist()}, "ditto's personal v-pass"),
    ({"algorithm": {"name": "fedrep"}, **persist()}, "fedrep's head and body phases"),
    ({"algorithm": {"name": "fednova", "momentum": 0.9}, "train": {"optimizer_state": "persist"}}, "fednova normalises"),
    ({"algorithm": {"name": "fedsgd"}, **persist()}, "fedsgd sends one full-batch gradient"),
    ({"algorithm": {"name": "ifca", "option": "gradient"}, **persist()}, "ifca sends one full-batch gradient"),
    ({"algorithm": {"name": "pfedme"}, **persist()}, "train.momentum: 0.9 pfedme's inner solve"),  # the older rule
]


@pytest.mark.parametrize("over,message", REFUSED, ids=[m.split()[0].strip(":'") + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_persist_is_refused_in_one_line(over, message):
    """Each refusal names train.optimizer_state (or the key that is refused first) and its fix, on one line;
    the same config with ``reset`` is valid, so it is persist that is refused."""
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    text = str(err.value)
    assert message in text and "\n" not in text, text
    if "pfedme" not in message:
        assert "optimizer_state=reset" in text, text
        validate(tiny_config(**{**over, "train": {**over["train"], "optimizer_state": "reset"}}))


@pytest.mark.parametrize("name", ["fedavg", "cfl", "ifca", "scaffold", "fedprox", "fedbabu", "fedper"])
def test_persist_is_accepted_where_the_trainers_step_is_the_local_update(name):
    validate(tiny_config(algorithm={"name": name}, **persist()))


def test_a_local_update_without_buffers_is_refused_when_it_returns(tmp_path):
    """A method that trains its clients without the trainers' SGD step (here FedAvg given a local solver)
    returns no buffers: the round refuses persist in one line rather than resetting them silently."""
    from flockfl.engine.schedule import LocalSpec

    prep = prepare(validate(tiny_config(**persist(rounds=1))), tmp_path)
    local_spec = prep.algorithm.local_spec

    def solver_spec(*a) -> LocalSpec:
        spec = local_spec(*a)
        spec.solver = lambda model, s, data, task: {k: v.clone() for k, v in s.init.items()}
        return spec

    prep.algorithm.local_spec = solver_spec
    with pytest.raises(ConfigError, match=r"^train.optimizer_state=persist: fedavg's local update returned no optimiser state"):
        run_rounds(prep)
