"""Per-client state in ClientTable: values, incremental checkpoints, verification, garbage collection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_resume_bit_identical, tiny_config
from flockfl.clientstate import ClientTable, collect_garbage, row_path
from flockfl.rounds import PLAIN, drive, prepare, run_rounds
from flockfl.state import (CheckpointError, ServerState, decode_state, encode_state, list_checkpoints, load_latest,
                           save_checkpoint)


def table(n=10):
    return ClientTable(n, {"w": torch.zeros(3, 2), "b": torch.ones(4, dtype=torch.bool)})


def rows_of(clients, value):
    n = len(clients)
    return {"w": torch.full((n, 3, 2), float(value)), "b": torch.zeros(n, 4, dtype=torch.bool)}


def state_with(t: ClientTable) -> ServerState:
    return ServerState(0, {"x": torch.zeros(1, 2)}, np.zeros(t.num_clients, np.int64), np.zeros((0, t.num_clients), np.int64),
                       algo={"t": t})


def test_unwritten_rows_read_the_default_and_scatter_leaves_the_old_table_alone():
    t = table()
    got = t.gather([0, 5])
    assert torch.equal(got["w"], torch.zeros(2, 3, 2)) and got["b"].all()
    t2 = t.scatter([5, 7], rows_of([5, 7], 2.5))
    assert not t.written().any()  # states are values: the old table is unchanged
    assert t2.written().tolist() == [i in (5, 7) for i in range(10)]
    got = t2.gather([7, 0, 5])
    assert got["w"][:, 0, 0].tolist() == [2.5, 0.0, 2.5] and got["b"].tolist()[1] == [True] * 4
    assert got["b"].dtype == torch.bool and not got["b"][0].any()
    assert torch.equal(t2.dense()["w"][[5, 7]], torch.full((2, 3, 2), 2.5))


def test_a_scatter_hashes_behind_and_every_reader_of_digests_waits_for_it(monkeypatch):
    """scatter returns before its rows are hashed; what needs no digest (reading the new rows) does
    not wait, and everything that reads digests (a copy, the state's digest, a pickle) gets them."""
    import copy
    import hashlib
    import pickle
    import threading

    from flockfl import clientstate

    gate = threading.Event()
    real = clientstate._hash_rows
    monkeypatch.setattr(clientstate, "_hash_rows", lambda *a: (gate.wait(10), real(*a)))
    t = table().scatter([1, 3], rows_of([1, 3], 2.0))
    assert not t._hashing.done()  # returned before hashing
    assert t.gather([3, 0])["w"][:, 0, 0].tolist() == [2.0, 0.0]  # the new rows are read from memory
    pickles: list = []
    pickled = threading.Thread(target=lambda: pickles.append(pickle.dumps(t)))
    pickled.start()
    pickled.join(0.2)
    assert pickled.is_alive() and not pickles  # pickling waits for the digests ...
    gate.set()
    pickled.join(10)
    later = t.scatter([3, 4], rows_of([3, 4], 5.0))  # a copy (after its parent's hashing), hashing behind
    row = torch.full((3, 2), 2.0).numpy().tobytes() + torch.zeros(4, dtype=torch.bool).numpy().tobytes()
    b_first = torch.zeros(4, dtype=torch.bool).numpy().tobytes() + torch.full((3, 2), 2.0).numpy().tobytes()
    want = hashlib.sha256(b_first if t.names[0] == "b" else row).digest()
    assert t.digest(1) == t.digest(3) == want
    assert later.digest(1) == want and later.digest(3) != want and later.written().sum() == 3
    restored = pickle.loads(pickles[0])  # ... and carries them, without the future
    assert restored._hashing is None and restored.digest(3) == want
    assert copy.deepcopy(later).digest(4) == later.digest(4)
    assert state_with(later).digest() == state_with(pickle.loads(pickle.dumps(later))).digest()


def test_scatter_refuses_rows_that_do_not_fit():
    with pytest.raises(ValueError, match="shape"):
        table().scatter([1], {"w": torch.zeros(1, 2, 3), "b": torch.zeros(1, 4, dtype=torch.bool)})
    with pytest.raises(ValueError, match="do not match"):
        table().scatter([1], {"w": torch.zeros(1, 3, 2)})


def test_flush_writes_only_the_dirty_rows_and_keeps_the_value(tmp_path):
    t = table().scatter([1, 2, 3], rows_of([1, 2, 3], 1.0))
    before = state_with(t).digest()
    assert t.flush(tmp_path) == 3 * t.row_nbytes
    assert t.dirty == {} and t.flush(tmp_path) == 0  # nothing new: nothing written
    assert state_with(t).digest() == before  # flushing changes where rows live, not the value
    t2 = t.scatter([3, 4], rows_of([3, 4], 9.0))
    assert t2.flush(tmp_path) == 2 * t.row_nbytes  # the next checkpoint writes only what changed
    assert t2.gather([1, 3, 4])["w"][:, 0, 0].tolist() == [1.0, 9.0, 9.0]
    assert t.gather([3])["w"][0, 0, 0] == 1.0  # the older table still reads its own row 3
    assert len(list(tmp_path.rglob("*.row"))) == 5


def test_a_corrupt_or_missing_row_is_refused(tmp_path, monkeypatch):
    # rewritten in place within the file system's timestamp tick, a row could be served from the
    # row cache (the verified bytes): this reads the files themselves
    monkeypatch.setenv("FLOCKFL_ROW_CACHE_MB", "0")
    t = table().scatter([4, 6], rows_of([4, 6], 3.0))
    t.flush(tmp_path)
    path = row_path(tmp_path, 4, t.digest(4))
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        t.gather([4])
    row_path(tmp_path, 6, t.digest(6)).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        t.gather([6])
    assert t.gather([5])["w"].abs().sum() == 0  # an unwritten row needs no file


def test_rows_are_hashed_read_and_verified_the_same_on_two_threads(tmp_path, monkeypatch):
    """scatter's digests and gather's reads run on torch's threads: the same table, the same rows
    in the cohort's order, and a corrupt row among many still refused."""
    monkeypatch.setenv("FLOCKFL_ROW_CACHE_MB", "0")
    clients = [9, 2, 7, 0, 5, 3]
    rows = {"w": torch.arange(36, dtype=torch.float32).reshape(6, 3, 2), "b": torch.rand(6, 4) > 0.5}
    old = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            t = table().scatter(clients, rows)
            t.flush(tmp_path / str(threads))
            out[threads] = (t.all_digests(), t.gather(clients[::-1] + [1]))
        assert np.array_equal(out[1][0], out[2][0])
        for k in rows:
            assert torch.equal(out[1][1][k], out[2][1][k])
            assert torch.equal(out[2][1][k][:6], rows[k].flip(0))
        path = row_path(tmp_path / "2", 7, t.digest(7))
        path.write_bytes(path.read_bytes()[:-1] + b"\x01")
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            t.gather(clients)
    finally:
        torch.set_num_threads(old)


def test_rows_just_written_are_read_from_the_cache_until_their_file_changes(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    from flockfl import rowfiles as clientstate

    monkeypatch.setattr(clientstate, "ROW_CACHE", clientstate.RowCache())
    t = table().scatter([4, 6, 8], rows_of([4, 6, 8], 3.0))
    t.flush(tmp_path)
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real(self))
    assert t.gather([4, 6])["w"][:, 0, 0].tolist() == [3.0, 3.0] and reads == []  # from memory, not disk
    # a file replaced by another (a new inode) is read again, and refused if corrupt
    path = row_path(tmp_path, 4, t.digest(4))
    bad = path.with_name("bad")
    bad.write_bytes(path.read_bytes()[:-1] + b"\x01")
    os.replace(bad, path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        t.gather([4])
    row_path(tmp_path, 6, t.digest(6)).unlink()  # a removed file is missing, cached or not
    with pytest.raises(CheckpointError, match="missing"):
        t.gather([6])
    # a table read back from its checkpoint's directory fills the cache on its first read
    monkeypatch.setattr(clientstate, "ROW_CACHE", clientstate.RowCache())
    reads.clear()
    assert t.gather([8])["w"][0, 0, 0] == 3.0 and len(reads) == 1
    assert t.gather([8])["w"][0, 0, 0] == 3.0 and len(reads) == 1
    # FLOCKFL_ROW_CACHE_MB=0: every read goes to the file
    monkeypatch.setenv("FLOCKFL_ROW_CACHE_MB", "0")
    monkeypatch.setattr(clientstate, "ROW_CACHE", clientstate.RowCache())
    t.gather([8])
    t.gather([8])
    assert len(reads) == 3


def test_encode_decode_keeps_unflushed_rows_inline():
    t = table().scatter([2], rows_of([2], 7.0))
    s = state_with(t)
    back = decode_state(encode_state(s))
    assert back.digest() == s.digest()
    assert back.algo["t"].gather([2])["w"][0, 0, 0] == 7.0


def test_state_digest_depends_on_every_row():
    t = table().scatter([2], rows_of([2], 7.0))
    assert state_with(t).digest() != state_with(t.scatter([9], rows_of([9], 7.0))).digest()
    assert state_with(t).digest() == state_with(table().scatter([2], rows_of([2], 7.0))).digest()


def cfg_of(algo: dict, rounds: int, clients: int = 20, per_round: int = 4):
    from flockfl.experiments import validate

    return validate(tiny_config(algorithm=algo, partition={"num_clients": clients},
                                train={"rounds": rounds, "clients_per_round": per_round}))


def scaffold_cfg(rounds=6):
    return cfg_of({"name": "scaffold"}, rounds)


def test_scaffold_checkpoints_write_only_the_cohorts_rows_and_collect_old_ones(tmp_path):
    prep = prepare(scaffold_cfg(), tmp_path)
    run = tmp_path / "run"
    counts = []

    def checkpoint(state, row):
        before = set(run.rglob("*.row"))
        save_checkpoint(state, run, keep=2)
        after = set(run.rglob("*.row"))
        counts.append(len(after - before))
        # every file left is referenced by one of the two kept checkpoints
        kept = [decode_state(p.read_bytes(), str(p), run).algo["c_clients"].files() for p in list_checkpoints(run)]
        assert {str(f.relative_to(run / "client_state" / "c_clients")) for f in after} == set().union(*kept)

    final = run_rounds(prep, on_round=checkpoint)
    assert counts and all(1 <= c <= 4 for c in counts)  # ≤ the cohort per round (a row that did not change is reused)
    table_ = final.algo["c_clients"]
    ckpt = list_checkpoints(run)[-1]
    # the checkpoint holds digests, not rows: far smaller than the dense [N, P] c_i it replaced
    assert ckpt.stat().st_size < 20 * table_.row_nbytes
    restored, _ = load_latest(run)
    assert restored.digest() == final.digest()
    for k, v in table_.dense().items():
        assert torch.equal(restored.algo["c_clients"].dense()[k], v), k


def test_garbage_collection_decodes_only_checkpoints_this_process_did_not_write(tmp_path, monkeypatch):
    """A pruned checkpoint's rows are compared with the kept ones' from the tables this process
    wrote; a checkpoint file replaced since (another process, a copy) is decoded, and what is
    collected is the same."""
    import flockfl.state as st

    cfg = scaffold_cfg(rounds=5)
    run = tmp_path / "run"
    run_rounds(prepare(cfg, tmp_path), until=3, on_round=lambda s, row: save_checkpoint(s, run, keep=2))
    decoded = []
    real = st.decode_state
    monkeypatch.setattr(st, "decode_state", lambda data, source="checkpoint", run_dir=None:
                        decoded.append(source) or real(data, source, run_dir))
    # written by this process: the next checkpoint's collection reads nothing back
    restored, _ = load_latest(run)
    decoded.clear()
    newest = list_checkpoints(run)[-1]
    data = newest.read_bytes()
    newest.unlink()
    newest.write_bytes(data)  # a new file (inode): what this process holds for it no longer counts
    ckpt_round_2 = list_checkpoints(run)[0]

    def checkpoint(state, row):
        save_checkpoint(state, run, keep=2)
        left = {str(f.relative_to(run / "client_state" / "c_clients")) for f in run.rglob("*.row")}
        kept = [real(p.read_bytes(), str(p), run).algo["c_clients"].files() for p in list_checkpoints(run)]
        assert left == set().union(*kept)

    drive(prepare(cfg, tmp_path), restored, PLAIN, on_round=checkpoint)
    # round 4 pruned round 2 (written here: from memory) beside the replaced round 3 (decoded);
    # round 5 pruned round 3 (decoded again: its file is still not this process's) beside round 4's
    assert decoded == [str(newest), str(newest)] and str(ckpt_round_2) not in decoded


def test_resume_from_the_previous_checkpoint_finds_its_rows(tmp_path):
    """The newest checkpoint is corrupt: the fallback one's rows must not have been collected."""
    cfg = scaffold_cfg(rounds=5)
    full = run_rounds(prepare(cfg, tmp_path))
    run = tmp_path / "run"
    run_rounds(prepare(cfg, tmp_path), until=4, on_round=lambda s, row: save_checkpoint(s, run, keep=2))
    newest = list_checkpoints(run)[-1]
    newest.write_bytes(newest.read_bytes()[:-10])
    restored, warnings = load_latest(run)
    assert restored.round == 3 and warnings
    assert drive(prepare(cfg, tmp_path), restored, PLAIN).digest() == full.digest()


def test_a_moved_run_directory_still_resumes(tmp_path):
    cfg = scaffold_cfg(rounds=3)
    full = run_rounds(prepare(cfg, tmp_path))
    half = run_rounds(prepare(cfg, tmp_path), until=2)
    save_checkpoint(half, tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "b")
    restored, _ = load_latest(tmp_path / "b")
    assert drive(prepare(cfg, tmp_path), restored, PLAIN).digest() == full.digest()


@pytest.mark.parametrize("algo", ["scaffold", "fedac"])
def test_resume_is_bit_identical_with_client_tables(algo, tmp_path):
    extra = {"k": 2} if algo == "fedac" else {}
    cfg = cfg_of({"name": algo, **extra}, rounds=4, clients=12)
    full, resumed = assert_resume_bit_identical(cfg, tmp_path)
    assert resumed.algo[{"scaffold": "c_clients", "fedac": "omega"}[algo]].written().sum() > 4


def test_garbage_collection_keeps_what_any_kept_state_refers_to(tmp_path):
    t1 = table().scatter([1], rows_of([1], 1.0))
    t1.flush(tmp_path / "client_state" / "t")
    t2 = t1.scatter([1], rows_of([1], 2.0))
    t2.flush(tmp_path / "client_state" / "t")
    assert collect_garbage(tmp_path, [{"t": t1}], [{"t": t1}, {"t": t2}]) == 0
    t3 = t2.scatter([1], rows_of([1], 1.0))  # back to t1's value: the same file
    assert collect_garbage(tmp_path, [{"t": t1}], [{"t": t3}]) == 0
    assert t1.gather([1])["w"][0, 0, 0] == 1.0
    assert collect_garbage(tmp_path, [{"t": t1}], [{"t": t2}]) == 1
    assert t2.gather([1])["w"][0, 0, 0] == 2.0
    with pytest.raises(CheckpointError):
        t1.gather([1])


def test_rows_come_back_in_the_order_the_table_was_given():
    t = ClientTable(3, {"z.weight": torch.zeros(2), "a.bias": torch.zeros(1), "m": torch.zeros(3)})
    assert list(t.gather([0])) == ["z.weight", "a.bias", "m"]
    assert list(decode_state(encode_state(state_with(t))).algo["t"].gather([1])) == ["z.weight", "a.bias", "m"]


def test_digests_ending_in_zero_bytes_survive(tmp_path):
    """A row whose SHA-256 ends in a NUL byte (1 in 256) is named and verified by all 32 bytes."""
    t = ClientTable(2000, {"w": torch.zeros(2)})
    t = t.scatter(np.arange(2000), {"w": torch.arange(4000, dtype=torch.float32).reshape(2000, 2)})
    assert any(t.digest(c).endswith(b"\x00") for c in range(2000))
    t.flush(tmp_path)
    back = decode_state(encode_state(state_with(t)), run_dir=None).algo["t"]
    assert torch.equal(back.dense()["w"], t.dense()["w"])


def test_a_checkpoint_holds_only_the_written_digests_while_they_are_the_fewer(tmp_path):
    """1,000 clients, 3 written: the payload holds those 3 (format 2), a few hundred bytes
    instead of 33 KB; once most are written, the dense form (format 1) is the smaller and is
    used. Both decode to the same table, and the format-1 payload of older checkpoints loads."""
    t = ClientTable(1000, {"w": torch.zeros(3, 2)}).scatter([3, 500, 999], {"w": torch.randn(3, 3, 2)})
    t.flush(tmp_path)
    sparse = t.payload()
    assert sparse["__client_table__"] == 2 and len(sparse["digests"]) == 3 * 32 and len(sparse["written"]) == 3 * 4
    back = ClientTable.from_payload(sparse, tmp_path)
    assert (back.all_digests() == t.all_digests()).all() and back.written().sum() == 3
    assert torch.equal(back.gather([500, 1])["w"], t.gather([500, 1])["w"])

    full = t.scatter(np.arange(950), {"w": torch.randn(950, 3, 2)})
    dense = full.payload()
    assert dense["__client_table__"] == 1 and len(dense["digests"]) == 1000 * 32
    assert (ClientTable.from_payload(dense).all_digests() == full.all_digests()).all()

    legacy = {**sparse, "__client_table__": 1, "digests": t.digests.tobytes(), "has": t.has.tobytes()}
    assert (ClientTable.from_payload(legacy, tmp_path).all_digests() == t.all_digests()).all()


def test_flush_writes_many_rows_whole_and_leaves_no_temp_files(tmp_path):
    t = ClientTable(5000, {"w": torch.zeros(8)}).scatter(np.arange(0, 5000, 3), {"w": torch.randn(1667, 8)})
    assert t.flush(tmp_path) == 1667 * 32
    files = list(tmp_path.rglob("*"))
    assert not [f for f in files if ".tmp" in f.name]
    assert sum(f.suffix == ".row" for f in files) == 1667
    back = ClientTable.from_payload(t.payload(), tmp_path)
    assert torch.equal(back.gather(np.arange(0, 5000, 3))["w"], t.gather(np.arange(0, 5000, 3))["w"])
