"""``flockfl server``: ``prefect server start`` on 127.0.0.1 with the UI and the services a
schedule needs (the per-process ephemeral API that ``flockfl run`` uses has them off), tied to
this process, which prints the UI URL and the ``PREFECT_API_URL`` to export."""

from __future__ import annotations

import os
import sys
import time

from flockfl.errors import UserError
from flows.apiserver import healthy
from flows.env import tie_to_parent


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


def cmd_server(args) -> int:
    import signal
    import subprocess

    port = args.port
    if not 0 < port < 65536:
        raise UserError(f"--port {port}: not a TCP port; pick one in 1-65535")
    if not _port_free(port):
        raise UserError(f"port {port} on 127.0.0.1 is in use (a server already running?); pick another with --port")
    url = f"http://127.0.0.1:{port}"
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=server_env(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=tie_to_parent())
    early, ready = _relay(proc)

    stop = {"by": "Ctrl-C"}

    def _term(signum, frame):  # `kill` of flockfl stops the server too
        stop["by"] = "SIGTERM"
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    try:
        t0 = time.monotonic()
        while not healthy(f"{url}/api", timeout=1.0):
            if proc.poll() is not None:
                last = next((ln for ln in reversed(early) if ln.strip()), "no output")
                raise UserError(f"the Prefect server exited during start-up (code {proc.returncode}): {last.strip()}")
            if time.monotonic() - t0 > 180:
                raise UserError(f"the Prefect server did not answer at {url}/api/health within 180 s")
            time.sleep(0.3)
        print(f"Prefect server ready in {time.monotonic() - t0:.0f}s (database in {home}); Ctrl-C stops it.\n"
              f"  UI:  {url}\n"
              f"  API: {url}/api\n"
              f"In the shell that runs flockfl schedule (or flockfl run, to see its runs in the UI):\n"
              f"  export PREFECT_API_URL={url}/api", flush=True)
        ready.set()
        return proc.wait()
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reached the server too (same process group): give it time to stop
        _stop(proc, first_wait=10 if stop["by"] == "Ctrl-C" else 0)
        print(f"flockfl: Prefect server stopped ({stop['by']})", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
        _stop(proc, first_wait=0)


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


def _stop(proc, first_wait: float) -> None:
    """Stop the server process: wait, then SIGTERM (uvicorn shuts down cleanly), then SIGKILL."""
    import subprocess

    for action, wait in ((None, first_wait), (proc.terminate, 15), (proc.kill, 10)):
        if proc.poll() is not None:
            return
        if action:
            action()
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def add_parser(sub) -> None:
    srv = sub.add_parser("server", help="start a Prefect server with its UI on 127.0.0.1 "
                                        "(for flockfl schedule, and to browse runs in the Prefect UI)")
    srv.add_argument("--port", type=int, default=4200)
    srv.set_defaults(handler=cmd_server)
