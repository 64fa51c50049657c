"""Changes to Prefect's own behaviour for flockfl's flows, applied when the experiment flow's
module (flows/experiment.py) loads: the end of a flow run no longer waits for Prefect's
heartbeat thread (:func:`heartbeats_without_join`), and a task run's result record no longer
walks the file system (:func:`result_keys_without_path_walks`)."""

from __future__ import annotations


def heartbeats_without_join() -> None:
    """Flow runs end without waiting for Prefect's heartbeat thread.

    A flow run sends heartbeats from a daemon thread that sleeps in 1 s steps; at the end of
    every flow run the sync engine joins it, which waits for the current step: 0.5 s per run
    on average, for nothing (the thread exits by itself at its next step). The engine's own
    ``join_on_exit`` switch (what its async engine uses) is set instead. Heartbeats still
    run while the flow does. Left alone if Prefect's function no longer has that switch."""
    import functools
    import inspect

    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if send is None or getattr(send, "flockfl_no_join", False):
        return
    if "join_on_exit" not in inspect.signature(send).parameters:
        return

    @functools.wraps(send)
    def no_join(engine, join_on_exit: bool = True):
        return send(engine, join_on_exit=False)

    no_join.flockfl_no_join = True
    flow_engine._send_heartbeats = no_join


def result_keys_without_path_walks() -> None:
    """A task run's result record without walking the file system.

    Every task run, even one that persists nothing (flockfl's tasks: ``persist_result=False``,
    results stay in memory), makes a result record whose storage key the local result storage
    turns into an absolute path: ``Path.resolve()`` of the base path and of the key, twice, one
    ``lstat`` per path component (18 a task run, ~1.3 ms of its ~7 ms measured; 7 task runs a
    round). Here the base path is resolved once per value and working directory, and a key
    that is a plain file name (Prefect's default: a random hex string) is joined to it: what
    the walk returns unless that name is a symlink. Any other key walks as before. Left alone
    if Prefect's storage no longer has that method."""
    import functools
    import os
    import re
    from pathlib import Path

    from prefect.filesystems import LocalFileSystem

    resolve = getattr(LocalFileSystem, "_resolve_path", None)
    if resolve is None or getattr(resolve, "flockfl_patched", False):
        return
    plain = re.compile(r"[A-Za-z0-9_-]+")

    @functools.lru_cache(maxsize=64)
    def base_of(basepath: str, cwd: str) -> Path:
        return Path(basepath).expanduser().resolve() if basepath else Path(".").resolve()

    @functools.wraps(resolve)
    def fast(self, path):
        if path is None or not isinstance(path, str) or not plain.fullmatch(path):
            return resolve(self, path)
        return base_of(self.basepath or "", os.getcwd()) / path

    fast.flockfl_patched = True
    LocalFileSystem._resolve_path = fast
