"""Checkpoints written behind the rounds (flockfl.state.CheckpointWriter): the next round runs while
the write is in flight, at most one is in flight, errors surface at the next submit, and the run's
states, checkpoints and row files are those of writing in the foreground."""

from __future__ import annotations

import threading
import time

import pytest

from flockfl import rowfiles
from flockfl.experiments import validate
from flockfl.rounds import PLAIN, drive, prepare, run_rounds
from flockfl.state import CheckpointWriter, decode_state, list_checkpoints, load_latest, save_checkpoint
from conftest import tiny_config


def test_submit_returns_before_the_write_and_the_next_submit_waits_for_it():
    writer, gate, done = CheckpointWriter(), threading.Event(), []
    writer.submit(lambda: (gate.wait(10), done.append(1)))
    assert done == []  # returned while the write waits
    second = threading.Thread(target=lambda: writer.submit(done.append, 2))
    second.start()
    second.join(0.2)
    assert second.is_alive() and done == []  # at most one write in flight: the next waits for it
    gate.set()
    second.join(10)
    writer.wait()
    assert done == [1, 2]  # in order


def test_a_failed_write_fails_the_next_submit_and_the_wait():
    writer = CheckpointWriter()
    writer.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.submit(lambda: None)
    writer.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.wait()
    writer.wait()  # reported once


def test_foreground_writes_in_the_caller(monkeypatch):
    monkeypatch.setenv("FLOCKFL_CHECKPOINT", "foreground")
    writer, where = CheckpointWriter(), []
    writer.submit(lambda: where.append(threading.current_thread().name))
    assert where == [threading.current_thread().name] and writer.pending is None


def test_a_checkpoint_holding_many_unflushed_rows_is_written_in_the_caller(tmp_path):
    """Rows a checkpoint has not written yet stay in memory while it is in flight: past MAX_HELD
    bytes it is written before the next round (whose peak they would add to)."""
    from flockfl.clientstate import ClientTable
    from flockfl.state import ServerState, unflushed_bytes

    import numpy as np
    import torch

    t = ClientTable(10, {"w": torch.zeros(5)}).scatter([1, 2, 3], {"w": torch.ones(3, 5)})
    state = ServerState(0, {"x": torch.zeros(1, 2)}, np.zeros(10, np.int64), np.zeros((0, 10), np.int64), algo={"t": t})
    assert unflushed_bytes(state) == 3 * 5 * 4
    t.flush(tmp_path)
    assert unflushed_bytes(state) == 0
    writer, where = CheckpointWriter(), []
    writer.submit(lambda: where.append(threading.current_thread().name), held=CheckpointWriter.MAX_HELD + 1)
    writer.submit(lambda: where.append(threading.current_thread().name), held=CheckpointWriter.MAX_HELD)
    writer.wait()
    assert where[0] == threading.current_thread().name and where[1].startswith("flockfl-checkpoints")


@pytest.mark.parametrize("algo", ["scaffold", "fedac"])
def test_rounds_overlapping_slow_writes_give_the_foreground_run(algo, tmp_path, monkeypatch):
    """Every write made slow, so the next round gathers and scatters the client table while the
    checkpoint thread flushes it: the same final state, checkpoints that resume to it, and on disk
    exactly the rows the kept checkpoints name."""
    cfg = validate(tiny_config(algorithm={"name": algo, **({"k": 2} if algo == "fedac" else {})},
                               partition={"num_clients": 20}, train={"rounds": 6, "clients_per_round": 5}))
    full = run_rounds(prepare(cfg, tmp_path))
    real = rowfiles.write_all
    overlapped = []

    def slow(rows):
        time.sleep(0.05)
        overlapped.append(threading.current_thread().name)
        real(rows)

    monkeypatch.setattr(rowfiles, "write_all", slow)
    monkeypatch.setattr("flockfl.clientstate.write_all", slow)
    run, writer = tmp_path / "run", CheckpointWriter()
    final = run_rounds(prepare(cfg, tmp_path), on_round=lambda s, row: writer.submit(save_checkpoint, s, run, 2))
    writer.wait()
    assert final.digest() == full.digest()
    assert overlapped and all(name.startswith("flockfl-checkpoints") for name in overlapped)
    restored, warnings = load_latest(run)
    assert not warnings and restored.digest() == full.digest()
    key = {"scaffold": "c_clients", "fedac": "omega"}[algo]
    named = set().union(*(decode_state(p.read_bytes(), str(p), run).algo[key].files() for p in list_checkpoints(run)))
    on_disk = {str(f.relative_to(run / "client_state" / key)) for f in (run / "client_state" / key).rglob("*.row")}
    assert on_disk == named
    # the checkpoint before the last resumes to the same end
    older = list_checkpoints(run)[0]
    state = decode_state(older.read_bytes(), str(older), run)
    assert drive(prepare(cfg, tmp_path), state, PLAIN).digest() == full.digest()
