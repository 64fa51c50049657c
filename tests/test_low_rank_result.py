"""A low-rank layer's weight leaves the cohort trainer as its factors (``LowRankWeight``): the
FedAvg mean is taken on them, anything else that reads ``TrainResult.params`` gets the weight
written out with the same bits as before, and the finite check reads the factors."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from flockfl.aggregation import mean_weights, weighted_mean
from flockfl.engine import LocalSpec, train_cohort
from flockfl.engine.dense import DenseCohort, LowRankWeight
from flockfl.engine.trainers import TrainResult
from models import build_model, init_params
from flockfl.rng import torch_generator

from test_engine import random_clients


def shared_start(n: int = 6, hidden: int = 32, steps: int = 3, batch: int = 4):
    data = random_clients([9, 17, 30, 12, 23, 14][:n])
    model = build_model("mlp", (1, 8, 8), 10, hidden)
    base = init_params(model, torch_generator(2, purpose="init"))
    init = {k: v.unsqueeze(0).expand(n, *v.shape) for k, v in base.items()}
    return model, data, LocalSpec(np.arange(n), init, 0.1, steps=steps, batch_size=batch)


def test_the_trainer_leaves_the_low_rank_weight_factored_and_params_writes_it_out_with_the_old_bits():
    model, data, spec = shared_start()
    res = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="dense")
    assert isinstance(res.raw_params["1.weight"], LowRankWeight)  # 64→32: rank 12 ≤ cap 16
    assert isinstance(res.raw_params["3.weight"], torch.Tensor)  # 32→10: dense from the start
    # the written-out weight is exactly what the cohort's own dense write-out gives
    cohort = DenseCohort(spec.init, ["1", "3"], 0.1, 4)
    from flockfl.engine.schedule import cohort_schedule, stack_schedule

    sched = stack_schedule(cohort_schedule(spec, data.train.sizes, 1, 0), data.train.offsets, spec.clients)
    for s in range(sched.steps):
        cohort.step(data.train.x[sched.index[s]], data.train.y[sched.index[s]], sched.weight[s], data.task)
    old = cohort.params()
    dense = res.params
    for k in old:
        assert torch.equal(dense[k], old[k]), k
    assert res.params is dense and not any(isinstance(v, LowRankWeight) for v in res.raw_params.values())


def test_the_mean_on_the_factors_is_the_mean_of_the_written_out_weights():
    model, data, spec = shared_start()
    res = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="dense")
    w = mean_weights(res.num_samples, "samples")
    fast = weighted_mean(res.raw_params, w)
    slow = weighted_mean(res.params, w)
    for k in slow:
        torch.testing.assert_close(fast[k], slow[k], rtol=1e-5, atol=1e-6)
    # and the clients moved: the mean is not the shared start
    assert (fast["1.weight"] - spec.init["1.weight"][0]).abs().max() > 1e-3


def test_pickling_and_replace_keep_the_result():
    model, data, spec = shared_start()
    res = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="dense")
    back = pickle.loads(pickle.dumps(res))  # a Dask worker's result crosses as a pickle
    assert isinstance(back.raw_params["1.weight"], LowRankWeight)
    torch.testing.assert_close(back.params["1.weight"], res.params["1.weight"], rtol=0, atol=0)
    moved = dataclasses.replace(res, loss=res.loss * 0)
    assert torch.equal(moved.params["1.weight"], res.params["1.weight"])


def _factored(D: torch.Tensor, A: torch.Tensor, base: torch.Tensor | None = None) -> LowRankWeight:
    return LowRankWeight(torch.zeros(D.shape[2], A.shape[2]) if base is None else base, D, A, 0.5)


def test_finite_reads_the_factors_and_writes_out_only_the_clients_it_cannot_bound():
    g = torch.Generator().manual_seed(0)
    D, A = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 7, generator=g)
    D[1, 0, 2] = float("nan")
    A[2, 1, 0] = float("inf")
    # client 3: finite factors whose product overflows float32 (each 1e20, 3 terms of 1e40)
    D[3], A[3] = 1e20, 1e20
    got = _factored(D, A).finite()
    assert got.tolist() == [True, False, False, False]
    exact = torch.isfinite(_factored(D, A).dense().reshape(4, -1)).all(1)
    assert got.tolist() == exact.tolist()
    # large but representable: bounded out of range, written out, and found finite
    D[3], A[3] = 1e17, 1e17
    assert _factored(D, A).finite()[3]
    # a norm past float's range (1e20² overflows) from a finite product (1e20 · 1e-20): checked exactly, finite
    D[3], A[3] = 1e20, 1e-20
    assert _factored(D, A).finite()[3]
    base = torch.zeros(5, 7)
    base[0, 0] = float("nan")  # a bad shared start: every client
    assert not _factored(D, A, base).finite().any()


def test_a_diverging_client_is_still_caught_by_the_shard_check():
    result = TrainResult(np.arange(4), {"w": _factored(torch.ones(4, 2, 3), torch.ones(4, 2, 2))},
                         np.ones(4, np.int64), np.ones(4, np.int64), np.zeros(4))
    result.raw_params["w"].D[2, 0, 0] = float("inf")
    assert result.finite().tolist() == [True, True, False, True]


@pytest.mark.parametrize("clients", [6, 12])
def test_fedavg_rounds_with_factored_means_track_the_written_out_means(clients, tmp_path):
    """A whole FedAvg run (the MLP with a low-rank first layer) against the same run with every
    weight written out before its mean: the same model up to float rounding."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    from conftest import tiny_config

    cfg = validate(tiny_config(model={"name": "mlp", "hidden": 64}, train={
        "rounds": 3, "clients_per_round": clients, "batch_size": 4, "local_steps": 5, "engine": "vectorized"}))
    runs = {}
    for how in ("factored", "written"):
        prep = prepare(cfg, tmp_path / how)
        if how == "written":
            agg = prep.algorithm.aggregate

            def written(state, ctx, spec, result, assign, agg=agg):
                result.params  # noqa: B018 (reading them writes them out)
                assert not any(isinstance(v, LowRankWeight) for v in result.raw_params.values())
                return agg(state, ctx, spec, result, assign)

            prep.algorithm.aggregate = written
        if how == "factored":  # the setting does take the low-rank path (rank 20 ≤ cap 32 of the 64→64 layer)
            state = prep.algorithm.init_state(prep.ctx)
            spec = prep.algorithm.local_spec(state, prep.ctx, np.arange(clients), 0)
            res = train_cohort(prep.ctx.model, spec, prep.ctx.data.train, prep.ctx.data.task, 0, 0)
            assert isinstance(res.raw_params["1.weight"], LowRankWeight)
        runs[how] = run_rounds(prep)
    for k, v in runs["written"].models.items():
        torch.testing.assert_close(runs["factored"].models[k], v, rtol=1e-4, atol=1e-6)


def test_the_prefect_flow_hands_the_factors_to_the_aggregate(tmp_path, monkeypatch):
    """Through ``flockfl``'s flow (real Prefect tasks): every round's mean is taken on the factors,
    and nothing writes the weights out (Prefect's result linking reads a task result's fields)."""
    from flockfl.experiments import validate
    from flows.experiment import run_experiment

    from conftest import tiny_config

    calls = {"mean": 0, "dense": 0}
    mean, dense = LowRankWeight.weighted_mean, LowRankWeight.dense

    def counted(name, fn):
        def wrapper(self, *args):
            calls[name] += 1
            return fn(self, *args)
        return wrapper

    monkeypatch.setattr(LowRankWeight, "weighted_mean", counted("mean", mean))
    monkeypatch.setattr(LowRankWeight, "dense", counted("dense", dense))
    cfg = validate(tiny_config(model={"name": "mlp", "hidden": 64}, train={
        "rounds": 2, "clients_per_round": 6, "batch_size": 4, "local_steps": 5, "engine": "vectorized",
        "eval_finetune": "off"}))
    (tmp_path / "run").mkdir()
    run_experiment(cfg, tmp_path / "run", str(tmp_path / "parts"), f"sqlite:///{tmp_path}/m.db", progress=False)
    assert calls == {"mean": 2, "dense": 0}


@pytest.mark.parametrize("steps", [np.array([1, 3, 6, 0, 4]), np.array([2, 2, 2, 2, 2]), np.array([9, 9, 1, 9, 5])])
def test_scaffold_correction_beside_the_factors_matches_the_reference(steps):
    """SCAFFOLD's step y ← y − η(g + c − c_i) from a shared start: the low-rank layer keeps the
    correction beside its factors (−η·s_c·(c − c_i) after s_c steps of client c, counted only while
    it steps), the dense layers subtract it each step; against the per-client reference loop, with
    clients of unequal steps and one that takes none (it must not move). 9 steps × 4 pass the rank
    cap (16) of the 64→32 layer: it is written out mid-pass and goes on dense."""
    from flockfl.engine import train_reference

    from conftest import rel_err

    data = random_clients([9, 17, 30, 12, 23])
    model = build_model("mlp", (1, 8, 8), 10, 32)
    base = init_params(model, torch_generator(2, purpose="init"))
    init = {k: v.unsqueeze(0).expand(5, *v.shape) for k, v in base.items()}
    g = torch.Generator().manual_seed(3)
    corr = {k: 0.1 * torch.randn(5, *v.shape, generator=g) for k, v in base.items()}
    spec = LocalSpec(np.arange(5), init, 0.05, batch_size=4, client_steps=steps, correction=corr)
    ref = train_reference(model, spec, data.train, data.task, seed=0, round=1)
    vec = train_cohort(model, spec, data.train, data.task, seed=0, round=1, method="dense")
    np.testing.assert_array_equal(vec.num_steps, ref.num_steps)
    factored = isinstance(vec.raw_params["1.weight"], LowRankWeight)
    assert factored == (steps.max() * 4 <= 16)
    if factored:
        w = mean_weights(vec.num_samples, "uniform")
        fast = weighted_mean(vec.raw_params, w)["1.weight"]
    assert rel_err(vec.params, ref.params) < 1e-5
    np.testing.assert_allclose(vec.loss, ref.loss, rtol=1e-4)
    if factored:
        torch.testing.assert_close(fast, weighted_mean(vec.params, w)["1.weight"], rtol=1e-5, atol=1e-6)
    for k in init:
        if steps[3] == 0:  # no step: exactly where it started, correction and all
            torch.testing.assert_close(vec.params[k][3], init[k][3], rtol=0, atol=0)
    # the correction did something: without it the clients end elsewhere
    plain = train_cohort(model, LocalSpec(np.arange(5), init, 0.05, batch_size=4, client_steps=steps),
                         data.train, data.task, seed=0, round=1, method="dense")
    assert rel_err(plain.params, ref.params) > 1e-3


@pytest.mark.parametrize("option", ["II", "I"])
def test_scaffold_rounds_on_the_factors_track_the_written_out_rounds(option, tmp_path):
    """SCAFFOLD from the factors (the mean Δx on them, option II's c_i⁺ = Σ_t g_t / K_i read off
    D_iᵀA_i) against the same rounds with every y_i written out first (the formula
    c_i − c + (x − y_i)/(K_i η)): the same models, c and c_i up to float rounding."""
    from flockfl.experiments import validate
    from flockfl.rounds import prepare, run_rounds

    from conftest import tiny_config

    cfg = validate(tiny_config(algorithm={"name": "scaffold", "option": option}, model={"name": "mlp", "hidden": 64}, train={
        "rounds": 3, "clients_per_round": 6, "batch_size": 4, "local_steps": 5, "engine": "vectorized"}))
    runs, seen = {}, {"factored": 0}
    for how in ("factored", "written"):
        prep = prepare(cfg, tmp_path / how)
        agg = prep.algorithm.aggregate

        def wrapped(state, ctx, spec, result, assign, agg=agg, how=how):
            if how == "written":
                result.params  # noqa: B018 (reading them writes them out)
            else:
                seen["factored"] += isinstance(result.raw_params["1.weight"], LowRankWeight)
            return agg(state, ctx, spec, result, assign)

        prep.algorithm.aggregate = wrapped
        runs[how] = run_rounds(prep)
    assert seen["factored"] == 3
    a, b = runs["factored"], runs["written"]
    for k in b.models:
        torch.testing.assert_close(a.models[k], b.models[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a.algo["c"][k], b.algo["c"][k], rtol=1e-4, atol=1e-6)
    everyone = np.arange(12)
    ca, cb = a.algo["c_clients"].gather(everyone, "cpu"), b.algo["c_clients"].gather(everyone, "cpu")
    for k in cb:
        torch.testing.assert_close(ca[k], cb[k], rtol=1e-4, atol=1e-6)
    assert any(float(v.abs().max()) > 0 for v in ca.values())  # the control variates moved


def _sharded(spec: LocalSpec, model, data, cuts):
    """The cohort trained shard by shard (as the round's shard loop does) and concatenated."""
    from flockfl.engine.schedule import restrict

    parts = [train_cohort(model, restrict(spec, slice(a, b)), data.train, data.task, seed=1, round=0, method="dense")
             for a, b in zip(cuts[:-1], cuts[1:])]
    return parts, TrainResult.concat(parts)


@pytest.mark.parametrize("with_correction", [False, True])
def test_shards_concatenate_to_one_factored_weight_with_the_bits_of_their_written_out_weights(with_correction):
    """Shards of one cohort (one shared start, the same pass length) join as one
    :class:`LowRankWeight`: the factors concatenated, SCAFFOLD's correction taken back as the rows of
    the tensor the shards were sliced from (no copy); written out, it is bit for bit the shards'
    written-out weights concatenated, as it was when the concatenation wrote them out."""
    model, data, spec = shared_start()
    if with_correction:
        g = torch.Generator().manual_seed(5)
        spec.correction = {k: 0.1 * torch.randn(6, *v.shape[1:], generator=g) for k, v in spec.init.items()}
    parts, joined = _sharded(spec, model, data, [0, 2, 5, 6])
    w = joined.raw_params["1.weight"]
    assert isinstance(w, LowRankWeight) and len(w) == 6
    if with_correction:
        src = spec.correction["1.weight"]
        assert w.drift[0].data_ptr() == src.data_ptr() and torch.equal(w.drift[0], src)  # a view, not a copy
    expected = {k: torch.cat([p.params[k] for p in parts]) for k in parts[0].params}
    for k, v in joined.params.items():
        assert torch.equal(v, expected[k]), k
    # and the whole cohort in one pass agrees with the shards (the same clients, the same steps)
    whole = train_cohort(model, spec, data.train, data.task, seed=1, round=0, method="dense")
    torch.testing.assert_close(weighted_mean(joined.raw_params, torch.full((6,), 1 / 6)),
                               weighted_mean(whole.raw_params, torch.full((6,), 1 / 6)), rtol=1e-5, atol=1e-6)


def test_shards_that_cannot_join_are_written_out_and_concatenated():
    """Different starts (two cells), or a copied correction (shards from other processes): the
    start differs → written out; the correction copied → joined with its rows concatenated."""
    model, data, spec = shared_start()
    parts, _ = _sharded(spec, model, data, [0, 3, 6])
    moved = dataclasses.replace(parts[1], params={k: v for k, v in parts[1].raw_params.items()})
    lw = moved.raw_params["1.weight"]
    moved.params = {**moved.raw_params, "1.weight": LowRankWeight(lw.base + 1.0, lw.D, lw.A, lw.lr)}
    expected = torch.cat([parts[0].params["1.weight"], moved.params["1.weight"]])
    joined = TrainResult.concat([parts[0], moved])
    assert isinstance(joined.raw_params["1.weight"], torch.Tensor)
    assert torch.equal(joined.params["1.weight"], expected)

    g = torch.Generator().manual_seed(5)
    spec.correction = {k: 0.1 * torch.randn(6, *v.shape[1:], generator=g) for k, v in spec.init.items()}
    parts, _ = _sharded(spec, model, data, [0, 3, 6])
    copied = pickle.loads(pickle.dumps(parts[1]))  # a Dask worker's result: its own tensors
    joined = TrainResult.concat([parts[0], copied])
    w = joined.raw_params["1.weight"]
    assert isinstance(w, LowRankWeight) and w.drift[0].data_ptr() != spec.correction["1.weight"].data_ptr()
    assert torch.equal(joined.params["1.weight"], torch.cat([p.params["1.weight"] for p in (parts[0], copied)]))


def test_rows_of_one_tensor_are_taken_back_as_a_view_and_anything_else_copied():
    from flockfl.engine.dense import _rows_of_one

    src = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(6, 4, 3)
    one_row = src[2:3].as_strided((1, 4, 3), (999, 3, 1), src[2:3].storage_offset())  # any first stride
    got = _rows_of_one([src[:2], one_row, src[3:]])
    assert got.data_ptr() == src.data_ptr() and torch.equal(got, src)
    gap = _rows_of_one([src[:2], src[3:]])  # not consecutive: a copy of those rows
    assert gap.data_ptr() != src.data_ptr() and torch.equal(gap, torch.cat([src[:2], src[3:]]))
    other = _rows_of_one([src[:3], src[3:].clone()])
    assert torch.equal(other, src) and other.data_ptr() != src.data_ptr()
