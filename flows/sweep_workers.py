"""A sweep's runs in processes (``flockfl sweep --parallel N``, ``flockfl repro --parallel N``):
this process and N − 1 worker processes take the sweep's jobs (a stack of cells, or one run)
from one queue, so the Python of N runs (their rounds' bookkeeping, evaluation, plots, MLflow
logging and model export) runs on N cores instead of taking turns under one interpreter lock.

A worker is ``python -m flows.sweep_workers FD``: it reads jobs as JSON lines on its standard
input and writes, on file descriptor FD, ``{"ready": true}`` once its imports are done (a job is
handed to it only then: one is kept for it meanwhile, :class:`Workers`), one line per child as that child ends
(its summary, its models exported, or its error) and one ``{"ran": job, "stop": …}`` line when a job's
rounds are over (its models may still be exporting: the next job starts meanwhile; ``stop``: a Ctrl-C
cut it, and the worker exits). Its own output goes to this
process's standard error. It uses this process's Prefect API (``PREFECT_API_URL``) and MLflow
store, and shares the cores (``FLOCKFL_MAX_THREADS``). This process alone writes sweep.json.

Stopping: a Ctrl-C reaches every process of the group; each stops its runs at their next
checkpoint (a worker reports its children as interrupted) and the sweep stops; running it
again continues it. A worker dies with this process (``PR_SET_PDEATHSIG``); a worker that
dies alone leaves its unreported children failed, each resumable.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from flows.sweep_jobs import Job, error_text, job_line


class Workers:
    """``n`` worker processes sharing ``jobs`` with this process, and a thread each that feeds its
    worker jobs and hands each reported child to ``on_child(child, summary, error, interrupted)``
    (``error`` a text).

    Which process takes which job: one job is kept for each worker still starting (importing), and
    this process takes the others (:meth:`next_local`), so N jobs for N processes (a stacked sweep's
    stacks) go one to each, while a long queue of runs keeps this process busy meanwhile."""

    def __init__(self, n: int, jobs: list[Job], uri: str, partitions_root: str, parent_run_id: Optional[str],
                 on_child: Callable):
        self.jobs, self.on_child = collections.deque(jobs), on_child
        self.args = (uri, partitions_root, parent_run_id)
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.interrupted = False
        self.cv = threading.Condition()
        self.starting = n  # workers not ready yet: a job is kept for each
        for i in range(n):
            read, write = os.pipe()
            proc = subprocess.Popen([sys.executable, "-m", "flows.sweep_workers", str(write)], stdin=subprocess.PIPE,
                                    stdout=sys.stderr.fileno(), pass_fds=(write,), text=True,
                                    preexec_fn=_tie(), env={**os.environ, "FLOCKFL_SWEEP_WORKER": str(i + 1)})
            os.close(write)
            self.procs.append(proc)
            t = threading.Thread(target=self._serve, args=(proc, os.fdopen(read)), name=f"flockfl-sweep-worker-{i + 1}",
                                 daemon=True)
            t.start()
            self.threads.append(t)

    def _take(self) -> Optional[Job]:
        with self.cv:
            return None if self.interrupted or not self.jobs else self.jobs.popleft()

    def next_local(self) -> Optional[Job]:
        """The next job for this process: waits while every job left is kept for a starting worker;
        None once none is left (or the sweep stops)."""
        with self.cv:
            while self.jobs and not self.interrupted:
                if len(self.jobs) > self.starting:
                    return self.jobs.popleft()
                self.cv.wait(1.0)
            return None

    def _ready(self) -> None:
        with self.cv:
            self.starting -= 1
            self.cv.notify_all()

    def _serve(self, proc: subprocess.Popen, results) -> None:
        """Feed ``proc`` one job at a time (the next once the last one's rounds are over), until none is left."""
        pending: dict[str, object] = {}  # key -> child, sent and not yet reported
        ready = False

        def send() -> bool:
            job = self._take()
            if job is None:
                return False
            pending.update({c.key: c for c in job.children})
            try:
                proc.stdin.write(job_line(job, *self.args) + "\n")
                proc.stdin.flush()
            except OSError:  # the worker is gone: its children are reported below
                pass
            return True

        try:
            for line in results:
                msg = json.loads(line)
                if "ready" in msg or "ran" in msg:  # imported (its job was kept for it), or a job's rounds are over
                    if "ready" in msg:
                        ready = True
                        self._ready()
                    if msg.get("stop"):  # the job was interrupted: the worker is stopping, and so is the sweep
                        self.interrupted = True
                    if not send():
                        _close(proc.stdin)  # no job left: the worker settles its last runs and exits
                    continue
                child = pending.pop(msg["key"])
                self.interrupted |= bool(msg.get("interrupted"))
                self.on_child(child, msg.get("summary"), msg.get("error"), bool(msg.get("interrupted")))
        finally:
            code = proc.wait()
            if not ready:  # died starting: its kept job goes to this process
                self._ready()
            for child in pending.values():  # what the worker never reported
                stopped = self.interrupted or code in (-2, 130)
                self.on_child(child, None, f"WorkerDied: the sweep's worker process ended (exit code {code}) "
                                           f"during this run; run the sweep again to continue it", stopped)

    def join(self, timeout: Optional[float] = None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))

    def stop(self) -> None:
        """Let each worker stop at its runs' next checkpoint (a Ctrl-C already reached them: this
        covers a stop from elsewhere), then wait for their reports."""
        import signal

        with self.cv:
            self.interrupted = True  # no job is handed out any more
            self.cv.notify_all()
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGINT)
                except OSError:
                    pass
        self.join(timeout=120)


def _close(pipe) -> None:
    try:
        pipe.close()
    except OSError:  # the worker is gone already
        pass


def _tie():
    from flows.env import tie_to_parent

    return tie_to_parent(os.getpid())


# ---------------------------------------------------------------------- the worker process


def _worker(fd: int) -> int:
    """Run the jobs read from standard input; report on ``fd`` (see the module's docstring)."""
    from flows.interrupt import install_lock_safe_sigint, interrupted, watch

    install_lock_safe_sigint()
    out = os.fdopen(fd, "w")
    lock = threading.Lock()
    settling: list[threading.Thread] = []

    def report(msg: dict) -> None:
        with lock:
            out.write(json.dumps(msg, default=str) + "\n")
            out.flush()

    def ended(key: str, summary: Optional[dict], err: Optional[BaseException]) -> None:
        if err is None:
            report({"key": key, "summary": summary})
        else:
            report({"key": key, "error": error_text(err), "interrupted": interrupted(err)})

    from flows.run_tracking import settle
    from flows.sweep_jobs import run_one, run_stacked

    report({"ready": True})  # imported: jobs now start at once

    def settle_all(items: list) -> None:
        for key, summary, err in items:
            if err is None:
                try:
                    settle(summary)
                except Exception as e:
                    summary, err = None, e
            ended(key, summary, err)

    with watch():
        for line in sys.stdin:
            job = json.loads(line)
            kids = [_WorkerChild(c) for c in job["children"]]
            names, tags = [c["name"] for c in job["children"]], [c["tags"] for c in job["children"]]
            args = (job["partitions_root"], job["uri"], job["parent_run_id"])
            try:
                if job["stack"]:
                    results = run_stacked(kids, names, tags, *args)
                else:
                    results = [run_one(kids[0], names[0], tags[0], *args)]
            except BaseException as err:  # the whole job failed (or was interrupted) before any run ended
                results = [(None, err)] * len(kids)
            items = [(k.key, s, e) for k, (s, e) in zip(kids, results)]
            stop = any(e is not None and interrupted(e) for _, _, e in items)
            t = threading.Thread(target=settle_all, args=(items,), name="flockfl-sweep-settle")
            t.start()
            settling.append(t)
            report({"ran": job["id"], "stop": stop})
            if stop:
                break
    for t in settling:
        t.join()
    out.close()
    return 0


class _WorkerChild:
    """A child as a worker gets it: its key, config and run directory."""

    def __init__(self, d: dict):
        from flockfl.experiments import validate

        self.key, self.cfg, self.run_dir = d["key"], validate(d["config"]), Path(d["run_dir"])


if __name__ == "__main__":
    os._exit(_worker(int(sys.argv[1])))
