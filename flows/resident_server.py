"""The resident flockfl's server side (the client and what its children use: flows/resident.py).

``python -m flows.resident_server serve KEY`` (started by :func:`flows.resident.spawn`): import
torch, Prefect, MLflow, flockfl and what commands were seen to import, then serve commands on
the key's Unix socket, forking a child for each, in one thread.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flows import resident
from flows.resident import PRELOAD, _learned, _recv, _send, folder, learn

# ------------------------------------------------------------------ the resident


class Resident:
    """The serving loop: one thread, no torch operation, children forked per command."""

    def __init__(self, k: str, idle_s: float):
        self.key, self.idle_s = k, idle_s
        self.path = folder() / f"{k}.sock"
        self.children: dict[int, socket.socket] = {}  # pid -> the client's connection
        self.channels: dict[socket.socket, int] = {}  # the children's requests (API servers) -> pid
        # (home, database) -> [Popen, url, when its last user ended, the pids using it]
        self.servers: dict[tuple, list] = {}
        self.api_idle_s = float(os.environ.get("FLOCKFL_RESIDENT_API_IDLE_S", "300"))
        self.detached: set[int] = set()  # children that reported their exit and finish on their own

    def serve(self) -> None:
        import fcntl

        self._lock = open(folder() / f"{self.key}.lock", "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another resident of this key is starting or serving
        from flows.env import configure_environment

        configure_environment()
        os.environ.setdefault("MPLBACKEND", "Agg")
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
        self._imported: set = set()
        self._import_learned()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)  # handled in the loop (the wake-up fd)
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(64)
        pidfile = folder() / f"{self.key}.pid"
        pidfile.write_text(str(os.getpid()))
        last, stopping = time.monotonic(), False
        try:
            while True:
                busy = bool(self.children or self.detached)
                if stopping and not busy:
                    break
                timeout = self._expire_servers()
                if not busy:
                    left = max(0.0, self.idle_s - (time.monotonic() - last))
                    timeout = left if timeout is None else min(timeout, left)
                sources = [wake_r, *self.children.values(), *self.channels] + ([] if stopping else [listener])
                ready, _, _ = select.select(sources, [], [], timeout)
                if not ready and not busy and time.monotonic() - last >= self.idle_s:
                    break  # idle
                if wake_r in ready and self._signalled(wake_r) and not stopping:
                    stopping = True  # SIGTERM: no new command; the running ones finish
                    self.path.unlink(missing_ok=True)
                    listener.close()
                for s in ready:
                    if s is listener and not stopping:
                        self._accept(listener, wake_r, wake_w)
                        last = time.monotonic()
                    elif s in self.channels:
                        self._channel(s)
                    elif isinstance(s, socket.socket) and s is not listener:
                        self._client_gone(s)
                if self._reap():
                    self._import_learned()
                if self.children or self.detached:
                    last = time.monotonic()
        finally:
            if not stopping:
                self.path.unlink(missing_ok=True)
                listener.close()
            pidfile.unlink(missing_ok=True)
            for entry in self.servers.values():
                entry[0].terminate()
            for entry in self.servers.values():
                _stop_server(entry[0])

    def _signalled(self, wake_r: int) -> bool:
        try:
            got = os.read(wake_r, 512)
        except BlockingIOError:
            return False
        return signal.SIGTERM in got or signal.SIGINT in got

    def _accept(self, listener: socket.socket, wake_r: int, wake_w: int) -> None:
        conn, _ = listener.accept()
        try:
            request, fds = _recv(conn, maxfds=3)
        except (OSError, EOFError, ValueError):
            conn.close()
            return
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            listener.close()
            mine.close()
            for c in (*self.children.values(), *self.channels):
                c.close()
            os.close(wake_r)
            os.close(wake_w)
            _child(request, fds, conn, theirs)
        for fd in fds:
            os.close(fd)
        theirs.close()
        self.children[pid] = conn
        self.channels[mine] = pid
        try:
            _send(conn, {"pid": pid})
        except OSError:
            _kill(pid, signal.SIGKILL)

    def _client_gone(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1, socket.MSG_PEEK)
        except OSError:
            data = b""
        if data:
            return
        for pid, c in self.children.items():
            if c is conn:
                _kill(pid, signal.SIGKILL)  # as if the killed client's own process had died

    def _channel(self, ch: socket.socket) -> None:
        try:
            request, _ = _recv(ch)
        except (OSError, EOFError, ValueError):
            self.channels.pop(ch, None)
            ch.close()
            return
        if "detached" in request:  # the command's result is out: its client may go, the child finishes
            pid = self.channels[ch]
            conn = self.children.pop(pid, None)
            self.detached.add(pid)
            if conn is not None:
                try:
                    _send(conn, {"exit": request["detached"]})
                except OSError:
                    pass
                conn.close()
            return
        try:
            _send(ch, {"url": self._api(request["env"], self.channels[ch])})
        except Exception as err:  # noqa: BLE001 - the child reports it as its own one-line error
            _send(ch, {"error": f"{type(err).__name__}: {err}"})

    def _api(self, env: dict, pid: int) -> str:
        """The Prefect API for the child's Prefect home: started at the first request, kept while
        commands use it and ``FLOCKFL_RESIDENT_API_IDLE_S`` (300) seconds after the last one ended."""
        from flows import apiserver

        home = env.get("PREFECT_HOME", "")
        db = env.get("PREFECT_API_DATABASE_CONNECTION_URL") or env.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or ""
        entry = self.servers.get((home, db))
        if not entry or entry[0].poll() is not None:
            proc, url = apiserver.spawn_server(Path(home) / "logs", env, f"resident-{os.getpid()}")
            entry = self.servers[(home, db)] = [proc, url, time.monotonic(), set()]
        entry[3].add(pid)
        return entry[1]

    def _expire_servers(self) -> float | None:
        """Stop the API servers no command used for ``api_idle_s``; seconds until the next expiry."""
        now, nearest = time.monotonic(), None
        for k, (proc, _, since, users) in list(self.servers.items()):
            if users:
                continue
            left = self.api_idle_s - (now - since)
            if left <= 0 or proc.poll() is not None:
                _stop_server(proc)
                del self.servers[k]
            else:
                nearest = left if nearest is None else min(nearest, left)
        return nearest

    def _ended(self, pid: int) -> None:
        for entry in self.servers.values():
            if pid in entry[3]:
                entry[3].discard(pid)
                entry[2] = time.monotonic()

    def _import_learned(self) -> None:
        """Import what commands imported beyond :data:`PRELOAD` (recorded by :func:`learn`): their
        children then find it loaded. Imports only; a module that fails is left out."""
        import importlib

        for name in sorted(_learned() - self._imported):
            self._imported.add(name)
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except BaseException:  # noqa: BLE001 - optional: the command imports it itself
                    pass

    def _reap(self) -> bool:
        """Report the commands that ended (API servers are their Popen's to reap); whether any did."""
        ended = False
        for pid in list(self.detached):
            if _ended_status(pid) is not None:
                self.detached.discard(pid)
                self._ended(pid)
        for pid in list(self.children):
            status = _ended_status(pid)
            if status is None:
                continue
            conn = self.children.pop(pid)
            ended = True
            self._ended(pid)
            for ch, p in list(self.channels.items()):
                if p == pid:
                    del self.channels[ch]
                    ch.close()
            code = os.waitstatus_to_exitcode(status)
            try:
                _send(conn, {"exit": code})
            except OSError:
                pass
            conn.close()
        return ended


def _ended_status(pid: int) -> int | None:
    """The wait status of child ``pid`` if it ended (reaped now), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # already reaped elsewhere: an unknown failure
        return 1 << 8
    return status if done else None


def _stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _child(request: dict, fds: list, conn: socket.socket, channel: socket.socket) -> None:
    """In the forked child: become the client's process, run its command, exit with its status."""
    rc = 1
    try:
        conn.close()
        resident._channel = channel
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["flockfl", *request["argv"]]
        from flows import cli

        cli.PROCESS_START = request.get("start")
        before = set(sys.modules)
        import atexit

        atexit.register(lambda: learn(set(sys.modules) - before))
        rc = cli.run_and_finish(request["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must never return into the resident's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(rc)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "serve":
        Resident(argv[1], float(os.environ.get("FLOCKFL_RESIDENT_IDLE_S", "600"))).serve()
        return 0
    print("usage: python -m flows.resident_server serve KEY", file=sys.stderr)
    return 2


if __name__ == "__main__":  # run as flows.resident_server (not __main__): one copy of its state
    from flows import resident_server as _module

    sys.exit(_module.main(sys.argv[1:]))

