"""The resident ``flockfl``: torch, Prefect, MLflow and flockfl imported once, a command forked.

A ``flockfl`` process spends most of its fixed cost before its first line of work: importing
torch, Prefect, MLflow and flockfl (5–9 s of CPU on 2 cores) and starting a Prefect API server
(another ~5 s of CPU, ready after ~6 s). The resident is a background process per user and code
tree that did both once, as the Rails "spring" and Emacs' server do:

- ``flockfl run …`` (the client, this module's :func:`forward`, standard library only) connects
  to the resident's Unix socket and sends its arguments, working folder, environment and its
  stdin/stdout/stderr (the descriptors themselves, ``SCM_RIGHTS``);
- the resident forks; the child takes those descriptors, folder and environment, re-reads
  Prefect's settings from that environment and runs the command's ``main`` exactly as a fresh
  process would; its exit status goes back to the client, which exits with it (a child killed
  by a signal: the client kills itself with the same signal);
- signals the client gets (Ctrl-C, ``kill``) are passed on to the child; a client that dies
  (SIGKILL) takes its child with it (the resident sees the socket close and SIGKILLs it);
- the child's Prefect API: the resident keeps one server per Prefect home (and database), started
  at the first child that needs it, stopped when the resident ends (and by the kernel if the
  resident is killed: ``PR_SET_PDEATHSIG``). A configured ``PREFECT_API_URL`` is used as is.

The first command finds no resident: it runs as a plain process and, once it has done its
work, starts one in the background (so that the two do not share the cores while the command
runs); the resident binds its socket once its imports are done. A resident serves one code tree:
its key is the interpreter, the mtimes of flockfl's sources and of the installed packages,
and the environment variables read when torch and its libraries load (threads, ISA, MKL's
reproducible mode); another key gets another resident. It leaves after
``FLOCKFL_RESIDENT_IDLE_S`` seconds (default 600) without a command. ``FLOCKFL_RESIDENT=off``
runs every command as a plain process. The resident itself: flows/resident_server.py. Commands routed: :data:`ROUTED` (servers, UIs and
schedules run as plain processes: they live long and manage processes of their own).

The child must not inherit threads or state: the resident runs no thread, no torch operation
and no command itself (forking after OpenMP started is unsafe with libgomp); its children
re-seed Python's ``random`` (CPython does at fork) and start their own clocks; every draw
flockfl makes is seeded by (seed, round, client, purpose) anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROUTED = ("run", "resume", "partition", "list", "sweep", "repro", "report")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# read when torch, OpenMP, MKL, oneDNN, Python or git load: a resident's children inherit what the
# resident's imports saw, so these are part of its key (PREFECT_*/MLFLOW_* are read at run time)
IMPORT_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "ATEN_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_", "CUDA", "NVIDIA_",
              "PYTHON", "LD_", "LANG", "LC_", "GIT_PYTHON", "MPL", "OPENBLAS", "NUMEXPR", "TMPDIR")
PRELOAD = ("torch", "numpy", "prefect", "prefect.flow_engine", "prefect.task_engine", "prefect.client.orchestration",
           "mlflow", "mlflow.tracking", "psutil", "flows.cli", "flows.experiment", "flows.sweep", "flows.repro",
           "flows.report", "flows.run_summary", "flows.tracking.tracker", "flockfl.rounds", "flockfl.algorithms",
           "flockfl.data", "flockfl.evaluation", "tasks", "torch.export", "mlflow.pytorch", "sklearn.cluster",
           "scipy.optimize", "matplotlib.pyplot")
PACKAGES = ("flockfl", "flows", "tasks", "models")
_HEADER = struct.Struct("!I")


# ------------------------------------------------------------------ the key and the socket


def enabled() -> bool:
    return os.environ.get("FLOCKFL_RESIDENT", "auto").lower() not in ("off", "0", "false", "no") and \
        sys.platform.startswith("linux") and hasattr(socket, "send_fds")


def folder() -> Path:
    d = Path(os.environ.get("FLOCKFL_RESIDENT_DIR") or Path(tempfile.gettempdir()) / f"flockfl-{os.getuid()}")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def import_env(env: dict) -> dict:
    """The variables of ``env`` that the resident's imports read, with flockfl's defaults applied
    as ``flows.env.configure_environment`` applies them before torch loads."""
    from flows.env import with_defaults

    return {k: v for k, v in sorted(with_defaults(env).items()) if k.startswith(IMPORT_ENV)}


def key(env: Optional[dict] = None) -> str:
    """The code tree, interpreter and import-time environment this process would run with."""
    h = hashlib.sha256()
    h.update(f"{sys.executable}\0{sys.version}\0".encode())
    here = Path(__file__).resolve().parents[1]
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(here / pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, f))
                    h.update(f"{dirpath}/{f}\0{st.st_mtime_ns}\0{st.st_size}\0".encode())
    for entry in sys.path:  # a package installed or removed changes its site-packages folder
        if not entry.endswith(("site-packages", "dist-packages")):
            continue  # (the working folder's mtime changes with every run written into it)
        try:
            h.update(f"{entry}\0{os.stat(entry).st_mtime_ns}\0".encode())
        except OSError:
            pass
    h.update(json.dumps(import_env(dict(os.environ if env is None else env))).encode())
    return h.hexdigest()[:16]


def _send(sock: socket.socket, obj: dict, fds: tuple = ()) -> None:
    data = json.dumps(obj).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, buf: bytes = b"") -> bytes:
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict, list]:
    fds: list = []
    if maxfds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, maxfds)
        if not head:
            raise EOFError
    else:
        head = b""
    head = _recv_exact(sock, _HEADER.size, head)
    (n,) = _HEADER.unpack(head)
    return json.loads(_recv_exact(sock, n)), fds


# ------------------------------------------------------------------ the client


def process_start() -> float:
    """When this process started, as a Unix time, to the clock tick (/proc; psutil's
    ``create_time`` rounds the boot time to a second)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _command(argv: list[str]) -> Optional[str]:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def forward(argv: list[str]) -> Optional[int]:
    """Run ``flockfl argv`` in the resident and return its exit status, or None when this
    process must run it itself (off, not routed, no resident yet: one is then started)."""
    if not enabled() or _command(argv) not in ROUTED:
        return None
    k = key()
    path = folder() / f"{k}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        global pending_spawn
        pending_spawn = k  # started when this command has done its work (flows/cli.py): not beside it
        return None
    stdio = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:
            stdio.append(os.open(os.devnull, os.O_RDWR))
    try:
        _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "start": process_start()}, tuple(stdio))
        reply, _ = _recv(sock)
    except (OSError, EOFError):
        sock.close()
        return None  # the resident went away before forking: run here
    pid = reply["pid"]

    def pass_on(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, pass_on)
    while True:
        try:
            msg, _ = _recv(sock)
            break
        except InterruptedError:
            continue
        except (OSError, EOFError):
            print(f"flockfl: error: the resident flockfl ended before this command (pid {pid}) did; its exit status "
                  "is unknown (FLOCKFL_RESIDENT=off runs commands as plain processes)", file=sys.stderr)
            return 1
    code = msg["exit"]
    if code < 0:  # killed by a signal: end the same way
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


pending_spawn: Optional[str] = None  # the key of a resident to start once this plain command ends


def spawn(k: str) -> None:
    """Start the resident for key ``k`` in the background (a no-op if one is starting)."""
    lock = folder() / f"{k}.lock"
    try:
        import fcntl

        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a resident while it lives
    except OSError:
        return
    log = open(folder() / f"{k}.log", "ab")
    try:
        subprocess.Popen([sys.executable, "-m", "flows.resident_server", "serve", k], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True, cwd=str(Path(__file__).resolve().parents[1]),
                         env={**os.environ, "FLOCKFL_RESIDENT": "serve"})
    finally:
        log.close()


# ------------------------------------------------------------------ in a resident's child

_channel: Optional[socket.socket] = None


def api_url() -> Optional[str]:
    """In a resident's child: the resident's Prefect API for this process's Prefect home (started
    at the first request); None in a plain process."""
    if _channel is None:
        return None
    _send(_channel, {"env": dict(os.environ)})
    reply, _ = _recv(_channel)
    if "error" in reply:
        raise RuntimeError(f"the resident's Prefect API did not start: {reply['error']}")
    return reply["url"]


def in_child() -> bool:
    """Whether this process is a resident's child (a command the resident forked)."""
    return _channel is not None


def detach(rc: int) -> None:
    """In a resident's child: report ``rc`` to the client now (it exits with it) and let go of
    its terminal; this process then finishes on its own (the model export), writing nothing to
    it. Its errors go to the run's error.log and MLflow, as before."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _send(_channel, {"detached": rc})
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _learned_path() -> Path:
    return folder() / f"imports-{hashlib.sha256(sys.executable.encode()).hexdigest()[:12]}.txt"


def _learned() -> set:
    try:
        return set(_learned_path().read_text().split())
    except OSError:
        return set()


def learn(modules: set) -> None:
    """At a child's exit: add the modules its command imported to what residents preload: those
    of installed packages, the standard library and flockfl's own (which the key covers), never
    a project's plugin (its edits must be seen)."""
    import sysconfig

    here = Path(__file__).resolve().parents[1]
    roots = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}) + \
        tuple(str(here / p) for p in PACKAGES)
    new = set()
    for name in modules:
        f = getattr(sys.modules.get(name), "__file__", None)
        if f and name.isascii() and " " not in name and os.path.abspath(f).startswith(roots):
            new.add(name)
    known = _learned()
    if new <= known:
        return
    path = _learned_path()
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text("\n".join(sorted(known | new)))
    os.replace(tmp, path)


def stop(where: Optional[Path] = None) -> list[int]:
    """Ask every resident in ``where`` (default: :func:`folder`) to leave: they take no new
    command and exit once their running ones ended. Returns their pids."""
    pids = []
    for f in (where or folder()).glob("*.pid"):
        try:
            pid = int(f.read_text())
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (OSError, ValueError):
            f.unlink(missing_ok=True)
    return pids
