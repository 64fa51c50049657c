"""Quiet one thread's stderr, not the process's.

``contextlib.redirect_stderr`` swaps ``sys.stderr`` for every thread. A model export runs in a
background thread while the next run of a sweep trains and ``flockfl repro`` prints its estimate:
with the swap, those lines went into the export's sink whenever they happened to be printed
while an export was under way (a CI run lost ``flockfl repro``'s estimate that way).

:func:`quiet_stderr` instead puts a proxy in ``sys.stderr`` (once, while any thread is quiet)
that drops what the quiet threads write and passes every other thread's writes through.
"""
from __future__ import annotations

import contextlib
import sys
import threading

_LOCK = threading.Lock()
_STATE = threading.local()


class _Proxy:
    """``sys.stderr`` while some thread is quiet: the quiet threads' writes go nowhere."""

    def __init__(self, stream):
        self.stream = stream
        self.users = 0

    def write(self, text):
        if getattr(_STATE, "depth", 0):
            return len(text)
        return self.stream.write(text)

    def flush(self):
        if not getattr(_STATE, "depth", 0):
            self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def quiet_stderr():
    """Drop what this thread prints to ``sys.stderr`` inside the block; other threads print."""
    with _LOCK:
        proxy = sys.stderr if isinstance(sys.stderr, _Proxy) else _Proxy(sys.stderr)
        proxy.users += 1
        sys.stderr = proxy
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        with _LOCK:
            proxy.users -= 1
            if proxy.users == 0 and sys.stderr is proxy:  # the last quiet thread puts the stream back
                sys.stderr = proxy.stream
