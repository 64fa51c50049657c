"""Checkpoints: atomic, checksummed, refused when corrupt, pruned, and resumable bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds
from flockfl.state import CheckpointError, ServerState, decode_state, encode_state, list_checkpoints, load_latest, save_checkpoint

from conftest import tiny_config


def small_state(round=1, fill=0.0) -> ServerState:
    return ServerState(round, {"w": torch.full((2, 3), fill)}, np.array([0, 1, -1]), np.zeros((round, 3), np.int64),
                       algo={"m": torch.ones(3)}, history=[{"round": round, "accuracy": 0.5}], meta={"engine": "vectorized"})


def test_roundtrip_keeps_everything(tmp_path):
    s = small_state(fill=1.5)
    back = decode_state(encode_state(s))
    assert back.digest() == s.digest() and back.round == 1 and back.history == s.history and back.meta == s.meta
    torch.testing.assert_close(back.algo["m"], s.algo["m"])


def test_digest_sees_every_bit():
    a, b = small_state(), small_state()
    b.models["w"][0, 0] = float(np.nextafter(np.float32(0), np.float32(1)))  # one ulp
    assert a.digest() != b.digest()
    # nested algorithm state (control variates, optimiser moments) counts too
    c, d = small_state(), small_state()
    c.algo["c"] = {"w": torch.zeros(3)}
    d.algo["c"] = {"w": torch.tensor([0.0, 0.0, 1e-30])}
    assert c.digest() != d.digest()
    assert decode_state(encode_state(d)).digest() == d.digest()


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_corrupt_checkpoint_is_refused(damage):
    data = bytearray(encode_state(small_state()))
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    else:
        data[:5] = b"XXXXX"
    with pytest.raises(CheckpointError):
        decode_state(bytes(data))


def test_latest_good_checkpoint_is_used_when_newest_is_corrupt(tmp_path):
    for r in (1, 2, 3):
        save_checkpoint(small_state(r, fill=float(r)), tmp_path, keep=3)
    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash without atomic rename
    state, warnings = load_latest(tmp_path)
    assert state.round == 2 and len(warnings) == 1
    assert "checksum mismatch" in warnings[0] and newest.name in warnings[0]


def test_pruning_keeps_the_newest(tmp_path):
    for r in range(1, 7):
        save_checkpoint(small_state(r), tmp_path, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000004.pt", "ckpt-000005.pt", "ckpt-000006.pt"]
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))  # no temp files left behind


@pytest.mark.parametrize("algo", [{"name": "fedavg"}, {"name": "ifca", "k": 2}])
def test_resume_from_checkpoint_is_bit_identical(tmp_path, algo):
    cfg = validate(tiny_config(algorithm=algo, train={"rounds": 5}))
    full = run_rounds(prepare(cfg, tmp_path))
    prep = prepare(cfg, tmp_path)
    half = run_rounds(prep, until=2)
    save_checkpoint(half, tmp_path / "run")
    restored, _ = load_latest(tmp_path / "run")
    resumed = run_rounds(prepare(cfg, tmp_path), restored)  # a fresh process would rebuild everything
    assert resumed.digest() == full.digest()
    assert [h["round"] for h in resumed.history] == [1, 2, 3, 4, 5]


def test_eval_every_skips_evaluation_but_not_the_last_round(tmp_path):
    cfg = validate(tiny_config(train={"rounds": 5, "eval_every": 2}))
    state = run_rounds(prepare(cfg, tmp_path))
    assert [("accuracy" in h) for h in state.history] == [False, True, False, True, True]
    assert state.assignment_history.shape == (5, cfg.partition.num_clients)


def test_a_checkpoint_from_before_the_driver_record_resumes_with_its_driver_keys(tmp_path):
    """Checkpoints written before ``ServerState.driver`` kept the driver's keys in ``meta``: loading
    one moves them into the record (a run resumed across the upgrade keeps its engine, its
    pre-federation cost and its mid-round progress) and leaves the algorithm's keys in ``meta``."""
    import dataclasses

    from flockfl.state import DriverRecord, encode_payload

    cfg = validate(tiny_config(train={"rounds": 2, "engine": "reference"}))
    state = run_rounds(prepare(cfg, tmp_path / "a"))
    assert state.driver.engine == "reference" and state.driver.eval_protocol is not None
    old = state.to_payload()
    driver = old.pop("driver")
    old["meta"] = {**old["meta"], **{k: v for k, v in driver.items() if v is not None and k != "cycle"},
                   "partial_round": {"cycle": 1}}
    back = decode_state(encode_payload(old))
    want = dataclasses.asdict(dataclasses.replace(state.driver, partial_round={"cycle": 1}))
    got = dataclasses.asdict(back.driver)
    assert want.pop("trained") is not None and np.array_equal(got.pop("trained"), state.driver.trained)
    assert got == want and got["engine"] == "reference" and got["pre_federation"] is None
    assert back.meta == state.meta and "engine" not in back.meta
    assert isinstance(back.driver, DriverRecord) and back.digest() == state.digest()
