"""Cells trained together (flockfl.engine.stacking): each cell's pass inside a stack equals the
same pass alone, bit for bit where a client's arithmetic does not depend on its neighbours (dense
stacks, per-client terms), to float rounding for grouped convolutions; the stack's order is the
cells' own, and a failure stays with its cell."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flockfl.engine import LocalSpec, train_cohort
from flockfl.engine.functional import stack
from flockfl.engine.stacking import Stack, StackStopped, share_key
from flockfl.rng import torch_generator
from models import build_model, init_params

from test_engine import random_clients


def _cell(j: int, sizes, kind: str, model_name: str = "mlp"):
    """Cell j's model, data and spec for one pass (``kind``: what its algorithm adds)."""
    data = random_clients(sizes, seed=10 + j)
    model = build_model(model_name, (1, 8, 8), 10, 32)
    n = len(sizes)
    if kind == "fedavg":  # one shared start, broadcast (the dense trainer's low-rank layers)
        base = init_params(model, torch_generator(j, purpose="init"))
        init = {k: v.unsqueeze(0).expand(n, *v.shape) for k, v in base.items()}
    else:
        init = stack([init_params(model, torch_generator(j, client=i, purpose="init")) for i in range(n)])
    extra = {}
    g = torch.Generator().manual_seed(j)
    if kind in ("fedprox", "scaffold", "fednova", "momentum"):
        extra["momentum"] = 0.9
    if kind in ("fedprox", "fednova"):
        extra["prox_mu"] = 0.01 if kind == "fedprox" else 0.05
    if kind == "scaffold":
        extra["correction"] = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in init.items()}
    if kind == "fednova":
        extra["client_steps"] = np.array([1 + (3 * i) % 7 for i in range(n)])
    spec = LocalSpec(np.arange(n), init, 0.05, epochs=2, batch_size=4, **extra)
    return model, data.train, spec, 100 + j


def _alone_and_stacked(cells, rounds=(3,)):
    alone = [[train_cohort(m, s, d, "classification", seed, r) for r in rounds] for m, d, s, seed in cells]
    jobs = [(lambda m=m, d=d, s=s, seed=seed: [train_cohort(m, s, d, "classification", seed, r) for r in rounds])
            for m, d, s, seed in cells]
    st = Stack()
    out = st.run(jobs)
    assert all(err is None for _, err in out), [err for _, err in out]
    return alone, [v for v, _ in out], st


def _identical(a, b):
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
    np.testing.assert_array_equal(a.num_steps, b.num_steps)
    np.testing.assert_array_equal(a.loss, b.loss)
    np.testing.assert_array_equal(a.clients, b.clients)


@pytest.mark.parametrize("kinds", [["fedavg"] * 3, ["ifca"] * 3, ["momentum", "fedprox", "scaffold", "fednova"]])
def test_a_stacked_cell_equals_its_pass_alone_bit_for_bit(kinds):
    """FedAvg cells (each its own shared start: one low-rank GEMM per cell), cells from per-client
    starts (IFCA's cluster models), and FedAvg-with-momentum, FedProx, SCAFFOLD and FedNova in one
    pass (per-client μ, a zero correction, per-client step counts): each cell's bits alone."""
    sizes = [[5, 17, 30, 12], [9, 17, 3], [22, 8, 14, 6, 11], [7, 7, 19]]
    cells = [_cell(j, sizes[j], kind) for j, kind in enumerate(kinds)]
    alone, stacked, st = _alone_and_stacked(cells, rounds=(3, 4))
    for a, s in zip(alone, stacked):
        for ar, sr in zip(a, s):
            _identical(ar, sr)
    assert st.calls == 2 * len(cells) and st.passes == 2  # every pass of a round trained as one
    moved = [float((r[0].params["1.weight"] - c[2].init["1.weight"]).abs().max()) for r, c in zip(alone, cells)]
    assert min(moved) > 1e-3  # and training moved every cell


def test_cells_of_another_model_or_rate_train_beside_the_stack():
    """Passes that cannot share (another model, another learning rate) train alone, in the same
    barrier, and still equal their passes alone."""
    a = _cell(0, [5, 17, 30], "ifca")
    b = _cell(1, [9, 17, 3], "ifca", model_name="mclr")
    m, d, s, seed = _cell(2, [8, 8], "ifca")
    c = (m, d, LocalSpec(s.clients, s.init, 0.2, epochs=2, batch_size=4), seed)
    assert len({share_key_of(x) for x in (a, b, c)}) == 3
    alone, stacked, st = _alone_and_stacked([a, b, c])
    for x, y in zip(alone, stacked):
        _identical(x[0], y[0])
    assert st.passes == 3


def share_key_of(cell):
    from flockfl.engine.schedule import cohort_schedule
    from flockfl.engine.stacking import Call

    m, d, s, seed = cell
    call = Call(m, s, d, "classification", seed, 3, "auto")
    call.batches = cohort_schedule(s, d.sizes, seed, 3)
    return share_key(call)


def test_convolutional_cells_train_alone_on_the_cpu_and_merged_equal_to_rounding(monkeypatch):
    """On the CPU each convolutional cell trains its own pass (bit for bit); merged (as on a GPU:
    MERGE_CONVOLUTIONS) they equal their passes alone to float rounding."""
    from flockfl.engine import stacking

    cells = [_cell(j, [6, 9, 4], "ifca", model_name="lenet5") for j in range(3)]
    alone, stacked, st = _alone_and_stacked(cells)
    assert st.passes == st.calls == 3
    for a, s in zip(alone, stacked):
        _identical(a[0], s[0])
    monkeypatch.setitem(stacking.MERGE_CONVOLUTIONS, "cpu", True)
    alone, stacked, st = _alone_and_stacked(cells)
    assert st.passes == 1
    for a, s in zip(alone, stacked):
        for k in a[0].params:
            torch.testing.assert_close(s[0].params[k], a[0].params[k], rtol=1e-5, atol=1e-6)


def test_cells_run_one_at_a_time_in_their_own_order_and_failures_stay_with_their_cell():
    order = []

    def job(j, fail=False):
        def run():
            order.append((j, "start"))
            m, d, s, seed = _cell(j, [5, 6], "ifca")
            r = train_cohort(m, s, d, "classification", seed, 0)
            order.append((j, "trained"))
            if fail:
                raise ValueError(f"cell {j} failed")
            return r
        return run

    out = Stack().run([job(0), job(1, fail=True), job(2)])
    assert [e for e in order if e[1] == "start"] == [(0, "start"), (1, "start"), (2, "start")]
    assert order[:3] == [(0, "start"), (1, "start"), (2, "start")]  # each waits for the pass before the next starts
    assert out[0][1] is None and out[2][1] is None
    assert isinstance(out[1][1], ValueError)


def test_a_stopped_stack_stops_its_waiting_cells():
    def waits():
        m, d, s, seed = _cell(0, [5, 6], "ifca")
        return train_cohort(m, s, d, "classification", seed, 0)

    def boom(calls):
        raise KeyboardInterrupt

    st = Stack(on_pass=boom)
    with pytest.raises(KeyboardInterrupt):
        st.run([waits, waits])
    assert isinstance(StackStopped("x"), KeyboardInterrupt)


# ---------------------------------------------------------------------- whole runs as cells
def _runs(names: list[str], rounds: int = 2):
    from conftest import tiny_config
    from flockfl.experiments import validate

    algos = {"fedavg": {"name": "fedavg"}, "fedprox": {"name": "fedprox"}, "scaffold": {"name": "scaffold"},
             "fednova": {"name": "fednova"}, "ifca": {"name": "ifca", "k": 2}}
    return [validate(tiny_config(algorithm=algos[n], seed=s, train={"rounds": rounds, "engine": "vectorized"}))
            for s, n in enumerate(names)]


@pytest.mark.parametrize("names", [["fedavg", "fedprox", "scaffold", "fednova", "ifca"], ["fedavg"] * 3, ["ifca"] * 3])
def test_a_stacked_run_ends_in_the_state_of_the_run_alone(names, tmp_path):
    """Whole runs (select → train → cluster → aggregate → evaluate, 2 rounds) as cells of one stack:
    FedAvg, FedProx, SCAFFOLD, FedNova and IFCA side by side, and seeds of one method. Each ends in
    the state digest of the same run alone, and the passes were shared."""
    from flockfl.rounds import prepare, run_rounds

    cfgs = _runs(names)
    alone = [run_rounds(prepare(c, tmp_path / "p")).digest() for c in cfgs]
    st = Stack()
    out = st.run([lambda c=c: run_rounds(prepare(c, tmp_path / "p")).digest() for c in cfgs])
    assert [err for _, err in out] == [None] * len(cfgs)
    assert [v for v, _ in out] == alone
    assert st.passes < st.calls  # cells shared passes
    assert len(set(alone)) == len(alone)


def test_cells_with_a_shared_body_and_personal_heads_keep_their_low_rank_layers():
    """A start broadcast for some layers only (a shared body, per-client heads: FedPer, LG-FedAvg):
    the broadcast layers stay low-rank per cell, as alone, and the result is each cell's bits."""
    cells = []
    for j, sizes in enumerate([[5, 17, 30], [9, 17, 3, 12]]):
        m, d, s, seed = _cell(j, sizes, "ifca")
        base = init_params(m, torch_generator(50 + j, purpose="init"))
        init = {k: (base[k].unsqueeze(0).expand(len(sizes), *base[k].shape) if k.startswith("1.") else v)
                for k, v in s.init.items()}
        cells.append((m, d, LocalSpec(s.clients, init, 0.05, epochs=2, batch_size=4), seed))
    alone, stacked, st = _alone_and_stacked(cells)
    assert st.passes == 1
    for a, s in zip(alone, stacked):
        _identical(a[0], s[0])


def test_a_stop_never_lets_a_cell_go_on_without_its_pass(tmp_path):
    """A Ctrl-C reaches the stack's coordinator while one cell runs and the others wait for their
    turn or their pass: every cell stops at its next pass (none goes on with its pass's result
    unaccounted or an empty one, which would drop its clients and checkpoint a round that never
    trained), and resuming every cell from its checkpoints in a new stack ends in the states of
    the runs alone."""
    import os
    import signal

    from flockfl.rounds import PLAIN, drive, prepare, run_rounds
    from flockfl.state import load_latest, save_checkpoint

    cfgs = _runs(["ifca", "fedavg", "ifca"], rounds=4)
    full = [run_rounds(prepare(c, tmp_path / "p")).digest() for c in cfgs]
    dirs = [tmp_path / f"cell{i}" for i in range(len(cfgs))]

    def job(i, c, d, interrupt):
        def after(s, row):
            save_checkpoint(s, d)
            if interrupt and i == 1 and s.round == 2:  # cell 2 waits for its turn, its round-2 pass done
                os.kill(os.getpid(), signal.SIGINT)
        state, _ = load_latest(d)
        return drive(prepare(c, tmp_path / "p"), state, PLAIN, on_round=after).digest()

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # an xdist worker ignores SIGINT
    try:
        with pytest.raises(KeyboardInterrupt):
            Stack().run([lambda i=i, c=c, d=d: job(i, c, d, True) for i, (c, d) in enumerate(zip(cfgs, dirs))])
    finally:
        signal.signal(signal.SIGINT, before)
    states = [load_latest(d)[0] for d in dirs]
    assert [s.round for s in states] == [2, 2, 1]  # cell 2 stopped at its turn, before finishing round 2
    for s in states:
        assert all(row["clients_dropped"] == 0 for row in s.history)
    out = Stack().run([lambda i=i, c=c, d=d: job(i, c, d, False) for i, (c, d) in enumerate(zip(cfgs, dirs))])
    assert [v for v, _ in out] == full


# ---------------------------------------------------------------------- passes by length
@pytest.mark.parametrize("kind,model_name", [("ifca", "mlp"), ("fedprox", "mlp"), ("scaffold", "mlp"),
                                             ("momentum", "mlp"), ("fedavg", "mclr")])
def test_clients_of_very_unequal_schedules_train_in_passes_by_length_with_their_own_bits(kind, model_name):
    """A power-law cohort (2 to 120 samples: 1 to 60 steps) trains in passes of similar length
    (flockfl.engine.trainers.length_buckets); each client ends in the bits one pass gives it.
    Plain SGD from a shared start keeps one pass where the dense trainer's layers go low-rank (the
    MLP's), not where they have no room for a rank (MCLR's 10 outputs: FedAvg on FlexCFL's data)."""
    from flockfl.engine.schedule import cohort_schedule, stack_schedule
    from flockfl.engine.trainers import _low_rank, _one_pass, length_buckets

    sizes = [120, 3, 2, 64, 9, 33, 2, 17, 5, 90]
    m, d, s, seed = _cell(0, sizes, kind, model_name)
    if model_name == "mclr":
        s = dataclasses.replace(s, batch_size=10)  # FlexCFL's batch: no rank fits in half of 10 outputs
    sched = stack_schedule(cohort_schedule(s, d.sizes, seed, 3), d.offsets, s.clients)
    buckets = length_buckets(sched.active.sum(0).numpy())
    assert buckets is not None and len(buckets) >= 3
    assert not _low_rank(m, s, s.step_rates(3, sched.steps), "auto", sched.index.shape[2])
    if kind == "fedavg":
        mlp = _cell(0, sizes, kind)
        assert _low_rank(mlp[0], dataclasses.replace(mlp[2], batch_size=10), s.step_rates(3, sched.steps), "auto", 10)
    one = _one_pass(m, s, d, "classification", sched, s.step_rates(3, sched.steps))  # every client in one pass
    _identical(train_cohort(m, s, d, "classification", seed, 3), one)


def test_equal_schedules_keep_one_pass():
    from flockfl.engine.trainers import length_buckets

    assert length_buckets(np.array([10, 10, 9, 10])) is None
    assert length_buckets(np.array([10, 1, 1, 10])) is None  # padding at most half the work
    assert [b.tolist() for b in length_buckets(np.array([40, 1, 2, 3, 30, 4]))] == [[0, 4], [3, 5], [2], [1]]
