"""Core leases (flockfl.cores): runs on one machine take turns on its cores, with real processes.

Every test leases from its own folder (``FLOCKFL_CORES_DIR`` / ``directory=``) and a fixed set
of CPU ids, so it neither waits for nor blocks other flockfl runs on this machine.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, flock_env, last_json, run_flock, tiny_config
from flockfl import cores

HOLDER = """
import sys
from pathlib import Path
from flockfl.cores import Lease

want, cpus, folder = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")], Path(sys.argv[3])
lease = Lease(want, "test holder", directory=folder, cores=cpus, quiet_s=0).start()
print("queued", flush=True)
lease.wait()
print("granted", ",".join(map(str, lease.granted)), flush=True)
sys.stdin.read()  # hold the cores until the test closes our stdin
lease.release()
print("released", flush=True)
"""


class Holder:
    """A process that leases ``want`` of ``cpus`` and holds them until :meth:`release`."""

    def __init__(self, want: int, cpus: str, folder: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(want), cpus, str(folder)], cwd=ROOT,
                                     env=flock_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.lines.put), (self.proc.stderr, self.err.append)):
            threading.Thread(target=lambda s=stream, f=sink: [f(x.rstrip("\n")) for x in s], daemon=True).start()
        assert self.expect("queued", 60)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, prefix: str, timeout: float) -> str | None:
        """The next stdout line if it starts with ``prefix`` within ``timeout`` s, else None."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        assert line.startswith(prefix), (line, self.err)
        return line

    def granted(self, timeout: float = 30) -> list[int]:
        line = self.expect("granted", timeout)
        return [int(c) for c in line.split()[1].split(",")] if line else []

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.expect("released", 30)
        self.proc.wait(30)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def holders(tmp_path):
    made: list[Holder] = []

    def make(want: int, cpus: str = "0,1") -> Holder:
        made.append(Holder(want, cpus, tmp_path / "cores"))
        return made[-1]

    yield make
    for h in made:
        h.stop()


def test_two_holders_then_a_waiter_named_and_freed_by_sigkill(holders, tmp_path):
    """Two runs hold one core each; a third waits, says which PIDs hold them, and gets a core
    the moment one holder is SIGKILLed (the kernel drops a dead process's locks)."""
    a, b = holders(1), holders(1)
    assert sorted(a.granted() + b.granted()) == [0, 1]
    c = holders(1)
    assert c.granted(timeout=1.5) == []  # waits
    deadline = time.monotonic() + 10
    while not any("waiting for" in e for e in c.err) and time.monotonic() < deadline:
        time.sleep(0.05)
    msg = next(e for e in c.err if "waiting for" in e)
    assert msg.startswith("flockfl: waiting for 1 of 2 cores") and str(a.pid) in msg and str(b.pid) in msg, msg
    assert "FLOCKFL_CORE_LEASE=off" in msg and len([e for e in c.err if e]) == 1, c.err  # one line
    a.kill()
    assert c.granted(timeout=10), c.err
    assert set(cores.holders(tmp_path / "cores", [0, 1]).values()) == {f"{b.pid} test holder", f"{c.pid} test holder"}


def test_first_come_first_served(holders):
    """A run that needs both cores is not overtaken by later runs that need one: a free core
    waits for the head of the queue."""
    a = holders(1)
    assert a.granted() == [0]
    big = holders(2)
    assert big.granted(timeout=1.0) == []
    small = holders(1)
    assert small.granted(timeout=1.5) == []  # core 1 is free, but big queued first
    a.release()
    assert big.granted() == [0, 1]
    assert small.granted(timeout=1.0) == []
    big.release()
    assert small.granted() == [0]


def test_a_killed_waiter_leaves_no_place_in_the_queue(holders):
    a = holders(1)
    assert a.granted() == [0]
    big = holders(2)
    assert big.granted(timeout=1.0) == []
    big.kill()  # its ticket file stays behind, unlocked
    small = holders(1)
    assert small.granted() == [1]


def test_threads_of_one_process_lease_from_one_another(tmp_path):
    """flock locks belong to an open file: a sweep's threads queue like separate processes."""
    first = cores.Lease(2, "first", directory=tmp_path, cores=[0, 1])
    assert first.wait() >= 0 and first.granted == [0, 1]
    messages: list[str] = []
    second = cores.Lease(1, "second", directory=tmp_path, cores=[0, 1], quiet_s=0.2, on_wait=messages.append).start()
    time.sleep(0.8)
    assert not second.granted and len(messages) == 1 and f"PID {os.getpid()}" in messages[0]
    first.release()
    assert second.wait() < 5 and second.granted == [0]
    second.release()
    third = cores.Lease(5, "", directory=tmp_path, cores=[0, 1])  # more threads than cores: all of them
    assert third.wait() < 5 and third.granted == [0, 1]
    third.release()


def test_a_cancelled_request_gives_back_what_it_took(tmp_path):
    hold = cores.Lease(1, "", directory=tmp_path, cores=[0, 1])
    hold.wait()
    pending = cores.Lease(2, "", directory=tmp_path, cores=[0, 1], quiet_s=60).start()
    time.sleep(0.5)  # it took core 1 and waits for core 0
    pending.release()
    hold.release()
    assert cores.holders(tmp_path, [0, 1]) == {} and not [p for p in (tmp_path / "queue").iterdir()]


def test_opt_out(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOCKFL_CORES_DIR", str(tmp_path))
    monkeypatch.setenv("FLOCKFL_CORE_LEASE", "off")
    assert not cores.enabled() and cores.request(2, "x") is None
    monkeypatch.setenv("FLOCKFL_CORE_LEASE", "on")
    lease = cores.request(1, "x", cores=[0])
    assert lease is not None and lease.wait() >= 0 and lease.granted == [0]
    lease.release()


def test_thread_count_honours_omp_num_threads_and_train_threads(monkeypatch):
    from flockfl.engine import runtime
    from flockfl.engine.runtime import resolve_threads

    monkeypatch.delenv("FLOCKFL_MAX_THREADS", raising=False)
    # the user's value as the process started (what Dask's nannies set later is not the user's)
    monkeypatch.setattr(runtime, "USER_OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resolve_threads(0) == 3
    assert resolve_threads(0) == 3 and resolve_threads(1) == 1
    monkeypatch.setenv("FLOCKFL_MAX_THREADS", "1")  # flockfl sweep --parallel's share
    assert resolve_threads(0) == 1
    monkeypatch.setattr(runtime, "USER_OMP_NUM_THREADS", None)
    monkeypatch.delenv("FLOCKFL_MAX_THREADS")
    assert resolve_threads(0) == max(1, min(4, len(cores.usable_cores())))


def test_passive_wait_is_a_default():
    from flows.env import DEFAULTS

    assert DEFAULTS["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.slow
def test_same_digest_alone_waiting_and_sharing(tmp_path):
    """A tiny run gives the same final state alone, after waiting for its cores (held by this
    test, so the wait is certain), and with the lease off while the leased run trains beside it."""
    folder = tmp_path / "cores"
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(tiny_config(train={"rounds": 4})))
    env = {"FLOCKFL_CORES_DIR": str(folder)}
    usable = cores.usable_cores()

    def start(name: str, extra: dict | None = None) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"{name}.out"
        p = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "exp.yaml", "--json", "--no-progress",
                              "--run-dir", f"runs/{name}"], cwd=tmp_path, env=flock_env({**env, **(extra or {})}),
                             stdout=open(out, "w"), stderr=open(tmp_path / f"{name}.err", "w"), text=True,
                             start_new_session=True)
        return p, tmp_path / name

    def finish(p: subprocess.Popen, base: Path) -> tuple[dict, str]:
        try:
            assert p.wait(300) == 0, Path(f"{base}.err").read_text()[-3000:]
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        return last_json(Path(f"{base}.out").read_text()), Path(f"{base}.err").read_text()

    alone = run_flock(["run", "exp.yaml", "--json", "--no-progress", "--run-dir", "runs/alone"], tmp_path, env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    ref = last_json(alone.stdout)
    assert ref["cores_wait_s"] < 5 and len(ref["cores_leased"]) == min(ref["threads"], len(usable))

    blocker = cores.Lease(len(usable), "test blocker", directory=folder)
    blocker.wait()
    try:
        waiting, wbase = start("waiting")
        shared, sbase = start("shared", {"FLOCKFL_CORE_LEASE": "off"})
        deadline = time.monotonic() + 240
        while "waiting for" not in Path(f"{wbase}.err").read_text():
            assert waiting.poll() is None and time.monotonic() < deadline, Path(f"{wbase}.err").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        blocker.release()  # the leased run starts its rounds; the opted-out one may still be in its own
    s, _ = finish(shared, sbase)
    w, werr = finish(waiting, wbase)
    assert s["cores_wait_s"] == s["cores_queued_s"] == 0.0 and s["cores_leased"] == []
    # in line for over a second (its set-up went on meanwhile, so its rounds may have waited less)
    assert w["cores_queued_s"] > 1.0 and 0 <= w["cores_wait_s"] <= w["cores_queued_s"]
    assert len(w["cores_leased"]) == len(ref["cores_leased"])
    assert [ln for ln in werr.splitlines() if "waiting for" in ln][0].count(str(os.getpid())) == 1
    assert ref["threads"] == w["threads"] == s["threads"]
    assert w["state_sha256"] == s["state_sha256"] == ref["state_sha256"]
