"""The per-process Prefect API that ``flockfl run``, ``resume`` and ``sweep`` use without a server.

Prefect's own ephemeral mode starts its API server lazily, when the flow first needs a
client: the process then imports Prefect's whole server package (~2–4 s on 2 cores) only to
spawn it, and waits idle for it to answer (~4 s more). Its child also outlives a ``flockfl``
that is SIGKILLed, orphaned to init.

Here the same server (``uvicorn prefect.server.api.server:create_app``, ephemeral settings,
127.0.0.1, a free port) is spawned first thing, before torch, MLflow and Prefect are
imported, so it starts on the other core while this process imports and loads data; the
flow then finds it through ``PREFECT_API_URL``. The child is tied to this process:

- on Linux it gets ``PR_SET_PDEATHSIG`` (SIGTERM when its parent dies, however it dies) and
  exits by itself if the parent was already gone when it started;
- a normal exit stops it (``atexit``).

A ``PREFECT_API_URL`` the user configured (exported, or in the active Prefect profile: ``flockfl
server``, a Prefect server of their own, Prefect Cloud) is used as is and nothing is started.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Union

from flows.env import tie_to_parent

_server: Optional["ApiServer"] = None


class ApiServerError(RuntimeError):
    """The per-process Prefect API did not start; the message is one line."""


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether the Prefect API at ``api_url`` (``…/api``) answers its health check."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:  # refused, reset, timed out, HTTP error: not (yet) healthy
        return False


# What a flow run's start asks first (the client's API-version check, then its flow and flow-run
# tables): the server's first answer to each costs it ~0.1–0.4 s of lazy set-up on 2 cores
WARM_UP = (("GET", "/admin/version", None), ("POST", "/flows/filter", {"limit": 1}),
           ("POST", "/flow_runs/filter", {"limit": 1}), ("POST", "/task_runs/filter", {"limit": 1}))


def warm_up(api_url: str) -> None:
    """Send the server the read-only requests a flow run starts with, so that it sets itself up
    on its own core while this process imports torch and loads data (measured: the first flow
    run then starts in ~0.3 s instead of ~0.6 s). Errors are ignored: the flow will ask again."""
    import json
    import urllib.request

    for method, path, body in WARM_UP:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{api_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except Exception:
            return


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app_dir() -> str:
    spec = importlib.util.find_spec("prefect")  # found, not imported (importing costs ~2 s)
    if spec is None or not spec.submodule_search_locations:
        raise ApiServerError("Prefect is not installed; reinstall flockfl (./run test sets it up)")
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def _popen(app_dir: str, env: dict, log_path: Path) -> tuple[subprocess.Popen, int]:
    """Start the server (ephemeral settings, 127.0.0.1, a free port), tied to this process."""
    port = _free_port()
    env = {**env, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory",
           "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "error", "--lifespan", "on"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                preexec_fn=tie_to_parent(os.getpid()))
    return proc, port


def spawn_server(log_dir: Path, env: dict, tag: str) -> tuple[subprocess.Popen, str]:
    """A server the resident flockfl keeps for its children (flows/resident.py): (process, API URL)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, port = _popen(_app_dir(), env, log_dir / f"api-server-{tag}.log")
    return proc, f"http://127.0.0.1:{port}/api"


class KeptServer:
    """The resident's server for this process's Prefect home: waited for, never stopped here."""

    def __init__(self, api_url: str):
        self.api_url, self.ready = api_url, False

    def wait(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            self.ready = healthy(self.api_url)
            if not self.ready:
                time.sleep(0.05)
        if not self.ready:
            raise ApiServerError(f"the resident flockfl's Prefect API ({self.api_url}) did not answer within "
                                 f"{timeout:.0f} s (FLOCKFL_RESIDENT=off runs commands as plain processes)")


class ApiServer:
    """One ephemeral Prefect API server process, tied to this process."""

    def __init__(self, log_dir: Path, home: Optional[Path] = None):
        self.app_dir = _app_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"api-server-{os.getpid()}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.ready = False
        lock = _first_start_lock(home or log_dir.parent)
        self._spawn()
        # the first server of a new home holds the lock until it answers (migrated); then, in every
        # case, the server is warmed up while this process is still importing
        threading.Thread(target=self._when_ready, args=(lock,), daemon=True, name="flockfl-prefect-api-warmup").start()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        self.proc, self.port = _popen(self.app_dir, dict(os.environ), self.log_path)

    def _when_ready(self, lock, timeout: float = 120.0) -> None:
        """Hold ``lock`` (if any) until this server answers, exits or ``timeout`` passes (whatever
        this process does meanwhile: it may never wait for its API, e.g. after a config error),
        then warm the server up."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and self.proc.poll() is None and not healthy(self.api_url, timeout=1.0):
                time.sleep(0.05)
        finally:
            if lock is not None:
                lock.close()
        if self.proc.poll() is None:
            warm_up(self.api_url)

    def wait(self, timeout: float = 60.0) -> None:
        """Block until the API answers its health check (it started while we were importing)."""
        if self.ready:
            return
        deadline = time.monotonic() + timeout
        retries = 3
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                if code == 3 and retries:  # uvicorn: the port was taken meanwhile; another one
                    retries -= 1
                    self._spawn()
                    continue
                raise ApiServerError(f"Prefect's API server exited with code {code} while starting; "
                                     f"its log is {self.log_path}")
            if healthy(self.api_url):
                self.ready = True
                return
            time.sleep(0.05)
        raise ApiServerError(f"Prefect's API server did not answer within {timeout:.0f} s; its log is {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.returncode in (0, -signal.SIGTERM):
            self.log_path.unlink(missing_ok=True)  # nothing to read after a clean stop


def _database(home: Path) -> Optional[Path]:
    """The SQLite file of Prefect's database (None for another database)."""
    url = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL")
    if not url:
        return home / "prefect.db"
    if url.startswith("sqlite") and ":///" in url:
        return Path(url.split(":///", 1)[1]).expanduser()
    return None


def _first_start_lock(home: Path):
    """Several ``flockfl run``s started together on a new Prefect home: each server would create
    and migrate the same SQLite database at once ("database is locked", alembic errors). Every
    start takes an exclusive lock beside the database; a start that finds the database already
    there lets go at once, the first one keeps the lock until its server answers (migrated).
    Returns the held lock file, or None."""
    import fcntl

    db = _database(home)
    if db is None:
        return None
    db.parent.mkdir(parents=True, exist_ok=True)
    lock = open(db.parent / f".{db.name}.flockfl-lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    if db.exists() and db.stat().st_size > 0:
        lock.close()
        return None
    return lock


def configured_api_url() -> Optional[str]:
    """The Prefect API the user configured: ``PREFECT_API_URL``, else the active profile's
    (``prefect config set PREFECT_API_URL=…``), else a ``prefect.toml``/``.env`` in the working
    directory. Read without importing Prefect where possible (that import costs ~2 s)."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    local = [f for f in (Path("prefect.toml"), Path(".env")) if f.is_file() and "api" in f.read_text(errors="ignore").lower()]
    if not profiles.is_file() and not local:
        return None
    try:
        if local:
            raise ImportError  # Prefect's own settings resolve those files
        import tomllib

        data = tomllib.loads(profiles.read_text())
        active = os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral"
        return (data.get("profiles", {}).get(active) or {}).get("PREFECT_API_URL") or None
    except ImportError:  # Python 3.10 (no tomllib), or settings files only Prefect reads
        from prefect.settings import get_current_settings

        return get_current_settings().api.url or None
    except (OSError, ValueError):
        return None


def start(home: Optional[str] = None) -> Optional[Union[ApiServer, "KeptServer"]]:
    """Spawn the process's API server and point ``PREFECT_API_URL`` at it (once per process).

    Returns None when the user configured an API (``PREFECT_API_URL``) or the profile names one."""
    global _server
    if _server is not None:
        return _server
    if configured_api_url():
        return None
    from flows import resident

    try:
        kept = resident.api_url()  # a resident's child: the resident keeps one server per home
    except RuntimeError as err:
        raise ApiServerError(str(err)) from None
    if kept:
        _server = KeptServer(kept)
        os.environ["PREFECT_API_URL"] = kept
        return _server
    home_dir = Path(home or os.environ.get("PREFECT_HOME") or Path.cwd() / ".prefect")
    _server = ApiServer(home_dir / "logs", home_dir)
    atexit.register(_server.stop)
    os.environ["PREFECT_API_URL"] = _server.api_url
    # the ephemeral server never checks a client's version against its own: same package
    return _server


def wait_ready(timeout: float = 60.0) -> None:
    """Before the first flow: the API must answer (no-op for a configured PREFECT_API_URL)."""
    if _server is not None:
        _server.wait(timeout)
