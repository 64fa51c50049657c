"""Evaluation of what changed (``eval.reuse``, flockfl/eval_reuse.py): a client whose model and
data did not change since its last evaluation keeps its metrics, bit for bit; the store survives
a resume; reuse happens (counted) and a changed model or changed data is measured again."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import assert_resume_bit_identical, tiny_config

from flockfl.experiments import validate

FEW = {"partition": {"num_clients": 24}, "train": {"rounds": 4, "clients_per_round": 3}}
CASES = {
    "local": {"algorithm": {"name": "local"}},
    "ditto": {"algorithm": {"name": "ditto"}, "eval": {"conventions": "all"}},
    "pfedme": {"algorithm": {"name": "pfedme"}},  # every federating client trains (train_all_clients)
    "pfedme_cohort": {"algorithm": {"name": "pfedme", "train_all_clients": False}},
    "ifca": {"algorithm": {"name": "ifca", "k": 2}},
    "fedavg": {"algorithm": {"name": "fedavg"}},
    "local_shift": {"algorithm": {"name": "local"}, "shift": {"kind": "swap_all", "probability": 0.5}},
}


def cfg_of(case: str, reuse: bool = True, **over):
    from flockfl.config import deep_merge

    return validate(tiny_config(**deep_merge(deep_merge(deep_merge(FEW, CASES[case]), over),
                                             {"eval": {"reuse": reuse}})))


def counted_run(cfg, tmp_path, state=None):
    """The run, and what each evaluation measured and reused (``_eval_reuse.counts``, None when off)."""
    from flockfl.rounds import PLAIN, drive, evaluate_stage, prepare

    counts = []

    def evaluate(prep, st, r):
        m = evaluate_stage(prep, st, r)
        counts.append(dict(m["_eval_reuse"].counts) if m["_eval_reuse"] is not None else None)
        return m

    return drive(prepare(cfg, tmp_path), state, dataclasses.replace(PLAIN, evaluate=evaluate)), counts


def strip(h: dict) -> dict:
    return {k: v for k, v in h.items() if k != "round_time_s"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reuse_gives_the_metrics_and_states_of_measuring_every_client(case, tmp_path):
    on, counts = counted_run(cfg_of(case), tmp_path)
    off, none = counted_run(cfg_of(case, reuse=False), tmp_path)
    assert on.digest() == off.digest()
    assert [strip(h) for h in on.history] == [strip(h) for h in off.history]  # every metric, bit for bit
    assert none == [None] * 4 and off.driver.eval_reuse is None
    assert on.driver.eval_reuse and counts[0]["reused"] == 0


@pytest.mark.parametrize("case", ["local", "ditto", "pfedme_cohort"])
def test_clients_not_trained_are_not_measured_again(case, tmp_path):
    """A model per client: after the first evaluation only the clients the round trained are
    measured (Ditto, pFedMe: their personal rows; the global model changes every round)."""
    state, counts = counted_run(cfg_of(case), tmp_path)
    cohort = 3
    if case == "local":
        assert counts[0] == {"measured": 24, "reused": 0, "assigned/measured": 24, "assigned/reused": 0}
        for c in counts[1:]:
            assert c["measured"] <= cohort and c["reused"] >= 24 - cohort and c["measured"] + c["reused"] == 24
    else:
        written = [c["personal/measured"] + c["personal/reused"] for c in counts]
        assert written[0] <= cohort and written == sorted(written) and written[-1] > cohort
        for c in counts[1:]:
            assert c["personal/measured"] <= cohort and c["global/reused"] == 0 and c["global/measured"] == 24
        assert sum(c["personal/reused"] for c in counts) > 0


def test_a_shift_measures_every_client_again(tmp_path):
    """The data changed (a distribution shift each round): nothing is reused."""
    _, counts = counted_run(cfg_of("local_shift"), tmp_path)
    shifted = [c for c in counts if c["reused"] == 0]
    assert len(shifted) >= 2  # the first evaluation and at least one round the shift changed the data


@pytest.mark.parametrize("case", ["local", "ditto"])
def test_resume_reuses_what_the_uninterrupted_run_reuses(case, tmp_path):
    """The store is checkpointed: a resumed run reports the same metrics and reuses the same
    clients as the run it continues."""
    from flockfl.state import load_latest, save_checkpoint

    from flockfl.rounds import prepare, run_rounds

    cfg = cfg_of(case)
    full, resumed = assert_resume_bit_identical(cfg, tmp_path)
    assert [strip(h) for h in resumed.history] == [strip(h) for h in full.history]
    _, whole = counted_run(cfg, tmp_path)
    part = run_rounds(prepare(cfg, tmp_path), until=2)
    save_checkpoint(part, tmp_path / "run2")
    restored, _ = load_latest(tmp_path / "run2")
    assert restored.driver.eval_reuse  # in the checkpoint
    _, after = counted_run(cfg, tmp_path, restored)
    assert after == whole[2:] and after[0]["reused"] > 0


def test_a_changed_row_or_another_context_is_measured_again():
    """The store itself: equal fingerprints reuse, a changed fingerprint or context measures."""
    from flockfl.eval_protocol import ClientMetrics
    from flockfl.eval_reuse import EvalReuse

    calls = []

    def run(values):
        def measure(pos):
            calls.append(pos.tolist())
            v = values[pos]
            return ClientMetrics({"proportional": (v, v / 2, np.arange(len(pos), dtype=np.int64))})
        return measure

    store, clients = EvalReuse(), np.array([4, 1, 7])
    fps = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    first = store.measure("s", "ctx", 8, clients, fps, run(np.array([0.1, 0.2, 0.3])))
    again = store.measure("s", "ctx", 8, clients, fps, run(np.array([9.0, 9.0, 9.0])))
    assert calls == [[0, 1, 2]] and all(np.array_equal(a, b) for a, b in zip(first["proportional"], again["proportional"]))
    changed = fps.copy()
    changed[1, 15] ^= 1
    out = store.measure("s", "ctx", 8, clients, changed, run(np.array([5.0, 6.0, 7.0])))
    assert calls[-1] == [1] and out["proportional"][0].tolist() == [0.1, 6.0, 0.3]
    store.measure("s", "other data", 8, clients, changed, run(np.array([1.0, 1.0, 1.0])))
    assert calls[-1] == [0, 1, 2]
    restored = EvalReuse.restore(store.payload())
    got = restored.measure("s", "other data", 8, clients[:2], changed[:2], run(np.zeros(3)))
    assert len(calls) == 3 and restored.counts == {"measured": 0, "reused": 2, "s/measured": 0, "s/reused": 2}
    assert got["proportional"][0].tolist() == [1.0, 1.0]
