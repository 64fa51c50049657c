"""``flockfl server``: ``prefect server start`` on 127.0.0.1 with the UI and the services a
schedule needs (the per-process ephemeral API that ``flockfl run`` uses has them off), tied to
this process, which prints the UI URL and the ``PREFECT_API_URL`` to export.

Servers that flockfl starts for a person (this one, and ``flockfl ui``'s MLflow server) leave
nothing behind: :func:`start_group` runs them under a small guard process that leads a process
group of its own; the server and every process it starts (uvicorn and its workers) are in that
group. SIGTERM or SIGINT of flockfl stops the group (:func:`stop_group`); SIGKILL of flockfl
reaches the guard through Linux's parent-death signal, and the guard stops the group itself:
SIGTERM, then SIGKILL for what is left after ``grace`` seconds.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from flockfl.errors import UserError
from flows.apiserver import healthy

# The guard (``python -c GUARD PARENT_PID GRACE CMD...``): standard library only, so it starts in
# ~30 ms. It leads its own process group (start_new_session), asks the kernel for SIGTERM when
# its parent dies (PR_SET_PDEATHSIG: even a SIGKILL of the parent), starts CMD in its group and
# waits. On SIGTERM, SIGINT or SIGHUP, or when CMD exits, it stops the group's other members
# (SIGTERM, then SIGKILL after GRACE s) and exits: with CMD's exit code, or 0 when stopped.
GUARD = r"""# flockfl: the guard of a server's process group (flows/server.py)
import os, signal, subprocess, sys, time
parent, grace, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
stop = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, f: stop.append(n))
if sys.platform.startswith("linux"):
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:  # the parent died before the guard could tie itself to it
    sys.exit(1)
me, group = os.getpid(), os.getpgrp()

def others():
    if not os.path.isdir("/proc"):
        return None  # not Linux: members unknown, the group is killed whole
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                pids.append(int(d))
    return pids

def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass

child = subprocess.Popen(cmd) if not stop else None
while child is not None and child.poll() is None and not stop:
    time.sleep(0.1)
code = 0 if stop or child is None else child.returncode
try:
    os.killpg(group, signal.SIGTERM)  # the guard's own handler just notes it
except ProcessLookupError:
    pass
deadline = time.monotonic() + grace
while time.monotonic() < deadline:
    reap()
    left = others()
    if left == []:
        break
    time.sleep(0.1)
left = others()
if left is None:
    os.killpg(group, signal.SIGKILL)
for pid in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
reap()
sys.exit(code)
"""


def start_group(cmd: list[str], grace: float = 10.0, **popen):
    """Start ``cmd`` under the guard (see :data:`GUARD`): the returned ``Popen`` is the guard,
    which leads the process group of the server and everything it starts. ``popen``: more
    ``subprocess.Popen`` arguments (env, stdout, ...)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), str(grace), *cmd],
                            start_new_session=True, **popen)


def stop_group(proc, wait: float = 20.0) -> None:
    """Stop a group :func:`start_group` started: SIGTERM to its guard (which stops the group);
    if the guard is not gone after ``wait`` s, SIGKILL to the whole group."""
    import signal
    import subprocess

    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group (the guard leads it)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def on_sigterm(stop: dict):
    """Make SIGTERM (``kill``) of flockfl raise KeyboardInterrupt, as Ctrl-C does, so the same
    ``except``/``finally`` stops the server; ``stop["by"]`` says which. Returns the old handler."""
    import signal

    def _term(signum, frame):
        stop["by"] = "SIGTERM"
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, _term)


def server_env(port: int) -> dict:
    """The environment of ``prefect server start``: flockfl's defaults turn the UI and the
    server's services off (right for the ephemeral API of one ``flockfl run``); a server that
    keeps schedules needs them on. Its UI talks to its own API, whatever PREFECT_API_URL says."""
    from flows.env import DEFAULTS

    env = dict(os.environ)
    for key in DEFAULTS:
        if key.startswith("PREFECT_SERVER_SERVICES_") and key.endswith("_ENABLED"):
            env[key] = "true"
    env.pop("PREFECT_UI_ENABLED", None)  # the legacy alias flows.env sets
    url = f"http://127.0.0.1:{port}"
    env.update({"PREFECT_SERVER_UI_ENABLED": "true", "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
                "PREFECT_SERVER_UI_API_URL": f"{url}/api", "PREFECT_UI_API_URL": f"{url}/api", "PREFECT_API_URL": f"{url}/api",
                "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)})
    return env


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_port(port: int, what: str) -> None:
    """A one-line error unless ``port`` is a TCP port free on 127.0.0.1 (``what`` names the server
    that may already hold it)."""
    if not 0 < port < 65536:
        raise UserError(f"--port {port}: not a TCP port; pick one in 1-65535")
    if not _port_free(port):
        raise UserError(f"port {port} on 127.0.0.1 is in use ({what} already running?); pick another with --port")


def wait_until_up(proc, api_url: str, name: str, exited: Callable[[], str]) -> float:
    """Wait (3 minutes at most) until the server ``proc`` answers ``<api_url>/health``; one-line
    errors when it exits first (``exited()`` says how) or never answers. Returns the seconds waited."""
    t0 = time.monotonic()
    while not healthy(api_url, timeout=1.0):
        if proc.poll() is not None:
            raise UserError(f"the {name} exited during start-up (code {proc.returncode}){exited()}")
        if time.monotonic() - t0 > 180:
            raise UserError(f"the {name} did not answer at {api_url}/health within 180 s")
        time.sleep(0.3)
    return time.monotonic() - t0


def cmd_server(args) -> int:
    import signal
    import subprocess

    port = args.port
    check_port(port, "a server")
    url = f"http://127.0.0.1:{port}"
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    stop = {"by": "Ctrl-C"}
    old = on_sigterm(stop)  # `kill` of flockfl stops the server too
    proc = start_group(cmd, grace=15, env=server_env(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    early, ready = _relay(proc)
    try:
        waited = wait_until_up(proc, f"{url}/api", "Prefect server",
                               lambda: ": " + next((ln for ln in reversed(early) if ln.strip()), "no output").strip())
        print(f"Prefect server ready in {waited:.0f}s (database in {home}); Ctrl-C stops it.\n"
              f"  UI:  {url}\n"
              f"  API: {url}/api\n"
              f"In the shell that runs flockfl schedule (or flockfl run, to see its runs in the UI):\n"
              f"  export PREFECT_API_URL={url}/api", flush=True)
        ready.set()
        return proc.wait()
    except KeyboardInterrupt:
        # the server is in a process group of its own: a terminal's Ctrl-C reached flockfl only
        stop_group(proc)
        print(f"flockfl: Prefect server stopped ({stop['by']})", file=sys.stderr)
        return 0
    finally:
        stop_group(proc)
        signal.signal(signal.SIGTERM, old)


def _relay(proc):
    """Read the server's output: kept until it is ready (its banner suggests ``prefect config
    set``; flockfl prints what to export instead, and the kept lines explain a failed start),
    passed on to stderr afterwards (warnings, errors)."""
    import collections
    import threading

    early: collections.deque = collections.deque(maxlen=200)
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            if ready.is_set():
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                early.append(line)

    threading.Thread(target=pump, name="prefect-server-output", daemon=True).start()
    return early, ready


def add_parser(sub) -> None:
    srv = sub.add_parser("server", help="start a Prefect server with its UI on 127.0.0.1 "
                                        "(for flockfl schedule, and to browse runs in the Prefect UI)")
    srv.add_argument("--port", type=int, default=4200)
    srv.set_defaults(handler=cmd_server)
