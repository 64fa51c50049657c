"""Core leases: flockfl runs on one machine take turns on its cores instead of oversubscribing them.

A run that trains with n intra-op threads leases n of the cores it may use (its affinity set)
for its rounds, and gives them back when its rounds end. A lease is a set of ``flock(2)`` locks,
one file per core, in a per-user folder (``$XDG_RUNTIME_DIR/flockfl-cores``, else
``<tmp>/flockfl-cores-<uid>``; ``FLOCKFL_CORES_DIR`` chooses another): the kernel drops the locks
of a process that dies, even by SIGKILL, so a killed run never keeps its cores. ``flock`` locks
belong to an open file, not to a process, so the threads of one process (``flockfl sweep
--parallel``) lease cores from one another like separate processes do.

Runs that find too few free cores wait in line, first come first served: each waiter holds a
locked ticket file in ``queue/``; only the oldest live ticket takes cores, one at a time as they
free up, so a run that needs two cores is not overtaken for ever by runs that need one. A dead
waiter's ticket is unlocked and swept away by the next one who looks.

A lease never changes a run's thread count (that would change its bits; see
``flockfl.engine.runtime.resolve_threads``): a run waits for its cores, or, with
``FLOCKFL_CORE_LEASE=off``, shares them (same results, slower rounds). This module is stdlib only.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from flockfl.cachedir import switched_off

SWITCH = "FLOCKFL_CORE_LEASE"  # off / 0 / false / no: no lease (runs share the cores)
DIR = "FLOCKFL_CORES_DIR"
POLL_S = 0.1  # how often a waiting run looks again
QUIET_S = 0.5  # a wait shorter than this is not announced (the run ahead is just taking its cores)


def enabled() -> bool:
    return not switched_off(os.environ.get(SWITCH))


def usable_cores() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def lease_dir() -> Path:
    """The per-user folder of the lease files (created 0700; one owned by another user is refused)."""
    given = os.environ.get(DIR)
    if given:
        path = Path(given)
    else:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = Path(runtime) if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK) else None
        path = base / "flockfl-cores" if base else Path(tempfile.gettempdir()) / f"flockfl-cores-{os.getuid()}"
    return _prepared(path)


def _prepared(path: Path) -> Path:
    (path / "queue").mkdir(mode=0o700, parents=True, exist_ok=True)
    if hasattr(os, "getuid") and path.stat().st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; set {DIR} to a folder of yours")
    return path


def _try_lock(path: Path) -> Optional[int]:
    """An fd holding an exclusive flock on ``path`` (created if missing), or None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def holders(directory: Optional[Path] = None, cores: Optional[list[int]] = None) -> dict[int, str]:
    """Which cores are leased now, and by whom (``PID label``): a diagnostic, not a lock."""
    directory = directory or lease_dir()
    out = {}
    for cpu in cores if cores is not None else usable_cores():
        path = directory / f"cpu-{cpu}"
        fd = _try_lock(path)
        if fd is None:
            out[cpu] = _holder(path)
        else:
            os.close(fd)
    return out


class Lease:
    """A request for ``want`` cores (at most the usable ones). :meth:`start` queues for them in a
    background thread, so the run sets up meanwhile; :meth:`wait` blocks until they are granted and
    returns the seconds it blocked; :meth:`release` gives them back (or cancels the request).
    ``granted`` is the CPU ids held; ``queued_s`` the seconds from request to grant."""

    def __init__(self, want: int, label: str = "", *, directory: Optional[Path] = None,
                 cores: Optional[list[int]] = None, stream: Optional[TextIO] = None, poll_s: float = POLL_S,
                 quiet_s: float = QUIET_S, on_wait: Optional[Callable[[str], None]] = None):
        self.cores = cores if cores is not None else usable_cores()
        self.want = max(1, min(int(want), len(self.cores)))
        self.label = " ".join(label.split())[:80]
        self.dir = _prepared(Path(directory)) if directory else lease_dir()
        self.stream = stream if stream is not None else sys.stderr
        self.poll_s = poll_s
        self.quiet_s = quiet_s
        self.on_wait = on_wait
        self.granted: list[int] = []
        self.queued_s = 0.0
        self.waited_message: Optional[str] = None
        self._fds: dict[int, int] = {}
        self._ticket: Optional[tuple[int, Path]] = None
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public

    def start(self) -> "Lease":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="flockfl-cores", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> float:
        """Block until the cores are granted; the seconds this call blocked."""
        if self._thread is None:
            self.start()
        t = time.perf_counter()
        self._done.wait()
        if self._error:
            raise self._error
        return time.perf_counter() - t

    def release(self) -> None:
        self._cancel.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._drop_ticket()
            for fd in self._fds.values():
                os.close(fd)  # closing the only fd of the open file drops its flock
            self._fds.clear()

    def __enter__(self) -> "Lease":
        self.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ the queue

    def _run(self) -> None:
        try:
            self._acquire()
        except BaseException as err:  # re-raised by wait()
            self._error = err
        finally:
            self._done.set()

    def _acquire(self) -> None:
        self._take_ticket()
        announced = False
        while not self._cancel.is_set():
            ahead = self._live_tickets_ahead()
            if not ahead:
                with self._lock:
                    for cpu in self.cores:
                        if len(self._fds) == self.want:
                            break
                        if cpu in self._fds:
                            continue
                        fd = _try_lock(self.dir / f"cpu-{cpu}")
                        if fd is not None:
                            os.ftruncate(fd, 0)
                            os.pwrite(fd, f"{os.getpid()} {self.label}\n".encode(), 0)
                            self._fds[cpu] = fd
                    if len(self._fds) == self.want:
                        self.granted = sorted(self._fds)
                        self.queued_s = time.perf_counter() - self._t0
                        self._drop_ticket()
                        return
            if not announced and time.perf_counter() - self._t0 >= self.quiet_s:
                announced = True
                self._announce(ahead)
            self._cancel.wait(self.poll_s)

    def _take_ticket(self) -> None:
        """A locked ticket, renamed into the queue only once locked (a visible, unlocked ticket is a dead one)."""
        queue = self.dir / "queue"
        name = f"{time.time_ns():020d}-{os.getpid()}-{threading.get_ident()}"
        tmp = queue / f".{name}"
        fd = _try_lock(tmp)
        assert fd is not None, tmp  # a fresh, unique name
        os.pwrite(fd, f"{os.getpid()} {self.label}\n".encode(), 0)
        os.rename(tmp, queue / name)
        self._ticket = (fd, queue / name)

    def _drop_ticket(self) -> None:
        if self._ticket:
            fd, path = self._ticket
            self._ticket = None
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            os.close(fd)

    def _live_tickets_ahead(self) -> list[str]:
        """Holders of the live tickets older than ours (dead ones are removed)."""
        mine = self._ticket[1].name if self._ticket else ""
        ahead = []
        for path in sorted((self.dir / "queue").iterdir()):
            if path.name.startswith("."):  # a ticket being made; one a minute old lost its owner before its rename
                self._sweep_unborn(path)
                continue
            if path.name >= mine:
                continue
            fd = _try_lock(path)
            if fd is None:
                ahead.append(_holder(path))
                continue
            try:  # its owner died: sweep it away
                path.unlink()
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return ahead

    @staticmethod
    def _sweep_unborn(path: Path) -> None:
        try:
            if time.time() - path.stat().st_mtime < 60:
                return
        except FileNotFoundError:
            return
        fd = _try_lock(path)
        if fd is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)

    def _announce(self, ahead: list[str]) -> None:
        held = holders(self.dir, self.cores)
        for cpu in self._fds:
            held.pop(cpu, None)
        who = sorted({h.split(" ", 1)[0] for h in held.values()})
        parts = [f"cores {','.join(map(str, sorted(held)))} held by PID {', '.join(who)}" if held else "no core held"]
        if ahead:
            parts.append(f"{len(ahead)} run{'s' if len(ahead) > 1 else ''} queued ahead "
                         f"(PID {', '.join(sorted({a.split(' ', 1)[0] for a in ahead}))})")
        msg = (f"flockfl: waiting for {self.want} of {len(self.cores)} cores ({'; '.join(parts)}); setting up meanwhile "
               f"({SWITCH}=off shares them instead: same results, slower rounds)")
        self.waited_message = msg
        if self.on_wait:
            self.on_wait(msg)
        elif self.stream:
            print(msg, file=self.stream, flush=True)


def request(threads: int, label: str = "", **kw) -> Optional[Lease]:
    """Start queueing for ``threads`` cores (None when leases are off, ``FLOCKFL_CORE_LEASE=off``)."""
    if not enabled():
        return None
    try:
        return Lease(threads, label, **kw).start()
    except OSError as err:  # no writable lease folder: run without one, and say so
        print(f"flockfl: warning: no core lease ({err}); this run shares the cores", file=sys.stderr)
        return None
