"""A run's tracking on one background thread: the :class:`Tracker` calls, queued in order.

Importing MLflow, opening the store and exporting the models then overlap the run instead of
holding it up. A process that exits normally waits for every open tracker (:func:`close_all`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from flows.tracking.tracker import Tracker


class TrackingSkipped(RuntimeError):
    """A tracking call not made because an earlier one failed (that error is the cause)."""


_OPEN_TRACKERS: "set[BackgroundTracker]" = set()


class BackgroundTracker:
    """A :class:`Tracker` whose calls run in order on one background thread.

    Creating it returns at once: the thread imports MLflow, opens the store and creates (or
    re-opens) the run while the caller loads data and trains. Every call is queued and returns a
    ``Future``; ``run_id`` waits for the run to exist, ``check`` re-raises a failed call without
    waiting, ``close`` waits for everything queued. Once a call has failed the later ones are
    skipped (:class:`TrackingSkipped`), so a run never reads FINISHED after a lost log; only
    ``finish`` with another status still goes through. ``on_open`` runs on the thread with the
    new :class:`Tracker` (e.g. to write the new run id beside the checkpoints). ``seconds``: the
    thread's time per call name. A process that exits normally closes its trackers first
    (``atexit``); a killed one loses only what was queued, which a resume logs again.
    """

    def __init__(self, *args, on_open: Optional[Callable[[Tracker], None]] = None, **kwargs):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._rows: list = []  # history rows queued, not yet taken (log_rounds)
        self._rows_lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._tracker: Optional[Tracker] = None
        self.seconds: dict[str, float] = {}
        self._thread = threading.Thread(target=self._work, name="flockfl-tracking", daemon=True)
        self._thread.start()
        self._closed = False
        _OPEN_TRACKERS.add(self)

        def open_run(_) -> Tracker:
            self._tracker = Tracker(*args, **kwargs)
            if on_open:
                on_open(self._tracker)
            return self._tracker

        self._opened = self.submit(open_run, "open")

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, name, always = item
            if not fut.set_running_or_notify_cancel():
                continue
            if (self._error is not None and not always) or (self._tracker is None and name != "open"):
                err = TrackingSkipped(f"tracking call {name!r} skipped: an earlier one failed")
                err.__cause__ = self._error
                fut.set_exception(err)
                continue
            t = time.perf_counter()
            try:
                fut.set_result(fn(self._tracker))
            except BaseException as err:  # kept for check()/close(); the thread goes on
                self._error = self._error or err
                fut.set_exception(err)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def submit(self, fn: Callable[[Tracker], Any], name: str = "call", always: bool = False) -> Future:
        """Run ``fn(tracker)`` on the thread after everything queued before it."""
        if self._closed:
            raise RuntimeError("BackgroundTracker is closed")
        fut: Future = Future()
        self._queue.put((fut, fn, name, always))
        return fut

    @property
    def tracker(self) -> Tracker:
        """The open :class:`Tracker` (waits for it; raises if opening failed)."""
        return self._opened.result()

    @property
    def run_id(self) -> str:
        return self.tracker.run_id

    @property
    def experiment_id(self) -> str:
        return self.tracker.experiment_id

    def check(self) -> None:
        """Re-raise the first failed call, if any (does not wait)."""
        if self._error is not None:
            raise self._error

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every queued call and stop the thread; re-raise the first failure."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            _OPEN_TRACKERS.discard(self)
        if raise_errors:
            self.check()

    def _queued(name: str, always: Callable[..., bool] = lambda *a, **k: False):  # noqa: N805
        def call(self, *args, **kwargs) -> Future:
            return self.submit(lambda t: getattr(t, name)(*args, **kwargs), name, always(*args, **kwargs))

        call.__name__ = name
        call.__doc__ = f"Queue :meth:`Tracker.{name}`."
        return call

    def log_rounds(self, rows: list) -> Future:
        """Queue :meth:`Tracker.log_rounds`. Rows queued while the thread is busy go in one call
        (the first such call takes them all; the later ones find none): a stack's cells, or a
        fast run, log many rounds in one store transaction instead of one each."""
        with self._rows_lock:
            self._rows += rows

        def take(t: Tracker) -> None:
            with self._rows_lock:
                rows, self._rows = self._rows, []
            if rows:
                t.log_rounds(rows)

        return self.submit(take, "log_rounds")

    catch_up = _queued("catch_up")
    log_values = _queued("log_values")
    log_once = _queued("log_once")
    log_pre_federation = _queued("log_pre_federation")
    log_dict = _queued("log_dict")
    log_text = _queued("log_text")
    log_artifact = _queued("log_artifact")
    set_tags = _queued("set_tags")
    log_models = _queued("log_models")
    # a FAILED/KILLED status is recorded even after a failed call; FINISHED only if all went through
    finish = _queued("finish", always=lambda status="FINISHED": status != "FINISHED")
    del _queued


def close_all() -> None:
    """Wait for every tracker this process still has open (an exit handler: nothing queued is
    lost on a normal exit). Failures were reported where they happened."""
    for t in list(_OPEN_TRACKERS):
        t.close(raise_errors=False)


atexit.register(close_all)
