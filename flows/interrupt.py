"""Ctrl-C stops a sweep; it is not one more failed run.

A SIGINT during a sweep's run reaches the run's flow as ``KeyboardInterrupt``. Prefect's engine
then reports the crash to the API, which may already be going down, and what comes out of
``execute`` is that report's error (``httpx.ConnectError``), not the interrupt. The sweep took
it for one run failing, recorded it, and started the next run, which failed at once on the API
that was gone, and so on: a Ctrl-C during ``flockfl repro`` marked every run left as failed.

:func:`watch` notes a SIGINT while a sweep runs (and leaves the usual ``KeyboardInterrupt``
to happen); :func:`interrupted` says whether a run's error comes of one, from that note or from a
``KeyboardInterrupt`` / ``SystemExit`` anywhere in the error's chain.

:func:`lock_safe_sigint` is a command's Ctrl-C handler: Python's own raises ``KeyboardInterrupt``
wherever the main thread is, and once that was inside a ``threading.Condition.__enter__`` just
after the acquire, in Prefect's event queue: the lock was never released, and the crash report's
own ``put`` on that queue then waited for it forever (a Ctrl-C'd ``flockfl run`` hung, seen once in
the suite). Interrupted inside ``threading`` or ``queue`` code other than a wait, it sends the
signal again a few milliseconds later, out of the lock's code; waits are interrupted at once.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import queue
import signal
import threading
import time

_SEEN = threading.Event()

_LOCK_FILES = {threading.__file__, queue.__file__}
_WAITS = {"wait", "wait_for", "_wait_for_tstate_lock", "join"}  # blocking waits: safe to interrupt (they re-acquire)
RETRY_S = 0.005


def _in_lock_code(frame) -> bool:
    code = getattr(frame, "f_code", None)
    return code is not None and code.co_filename in _LOCK_FILES and code.co_name not in _WAITS


def _in_handler(frame) -> bool:
    """Whether ``frame`` is this handler's own (a signal sent again arrived before it returned)."""
    code = getattr(frame, "f_code", None)
    return code is not None and code.co_filename == __file__ and code.co_name == "lock_safe_sigint"


def lock_safe_sigint(signum, frame):
    """Python's Ctrl-C (``KeyboardInterrupt``), except inside ``threading``/``queue`` lock code,
    where the signal comes again ``RETRY_S`` later (see the module's docstring). The handler
    itself waits for nothing (a bare thread sends the signal again: ``threading.Thread.start``
    would wait for the thread to start, and the signal could come back inside that wait, still
    in the lock's code), and a signal that comes back before it returned is put off again."""
    if _in_lock_code(frame) or _in_handler(frame):
        _thread.start_new_thread(_send_again, (signum, RETRY_S))
        return
    raise KeyboardInterrupt


def _send_again(signum: int, delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signum)


def install_lock_safe_sigint() -> None:
    """Make :func:`lock_safe_sigint` this process's SIGINT handler where Python's own is (not
    where SIGINT is ignored, as in a script's background job), in the main thread."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, lock_safe_sigint)


@contextlib.contextmanager
def watch():
    """Note SIGINTs while the block runs (in the main thread; elsewhere this watches nothing)."""
    _SEEN.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:  # started with SIGINT ignored (a background job of a script): so be it
        yield
        return

    def noted(signum, frame):
        _SEEN.set()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, noted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_seen() -> bool:
    """Whether a SIGINT came since the sweep's :func:`watch` began (a run may have absorbed it)."""
    return _SEEN.is_set()


def from_keyboard_interrupt(err: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is in ``err``'s chain of causes and contexts: a Ctrl-C that
    landed in Prefect's task engine before its task run existed comes out as Prefect's own
    ``ValueError: Task run is not set``, raised while it handled the interrupt."""
    return _in_chain(err, (KeyboardInterrupt,))


def interrupted(err: BaseException) -> bool:
    """Whether ``err`` comes of an interrupt: a SIGINT seen by :func:`watch`, or a
    ``KeyboardInterrupt`` or ``SystemExit`` in its chain of causes and contexts."""
    return _SEEN.is_set() or _in_chain(err, (KeyboardInterrupt, SystemExit))


def _in_chain(err: BaseException, kinds: tuple) -> bool:
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, kinds):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
