"""Cells trained together: the cohorts of several runs (a sweep's or a table's cells) as one
vectorised pass of :func:`flockfl.engine.trainers.train_cohort`.

Each cell runs its own rounds (selection, clustering, aggregation, evaluation, checkpoints,
its own MLflow run) in a thread of a :class:`Stack`, one cell at a time: a cell runs until it
asks the vectorised trainer for a pass, then the next cell runs. When every cell still running
is waiting for a pass, the stack trains the waiting passes (:func:`train_calls`): those that
can share a pass (:func:`share_key`: the same model, task, device, step rates and extra terms,
the same padded batch width) as one cohort whose client axis is their cohorts side by side,
the rest alone; each cell gets its own rows back, and the cells run on. Which passes train
together is decided by the cells' own sequence of passes, never by timing, so a stacked sweep
is deterministic.

What a cell gets back equals its pass alone where the arithmetic of a client does not depend on
its neighbours on the client axis: dense stacks (MLP, MCLR, linear models; each cell's shared
start keeps its own low-rank GEMM) and the per-client batched matrix products of every model;
per-client μ (FedAvg beside FedProx), a zero correction (beside SCAFFOLD) and per-client step
counts (FedNova) add exact zeros. A grouped convolution's bits depend on how many clients share
it (as they do on a shard's size): convolutional cells share a pass only where
:data:`MERGE_CONVOLUTIONS` says (on a GPU, not on the CPU), and then equal their passes alone to
float rounding.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from flockfl.engine.data import Split
from flockfl.engine.schedule import LocalSpec, cohort_schedule, stack_schedule
from flockfl.engine.trainers import CELL as _local
from flockfl.engine.dense import shared_rows
from flockfl.engine.trainers import TrainResult, cohort_pass, convolutional, plain_sgd


def member() -> Optional["_Member"]:
    """The stack cell this thread runs (None outside a stack, and inside :func:`alone`)."""
    return getattr(_local, "member", None)


class alone:
    """A block whose passes train on their own (the engine probe times this run's cohort, not the stack's)."""

    def __enter__(self):
        self.saved, _local.member = member(), None

    def __exit__(self, *exc):
        _local.member = self.saved


class StackStopped(KeyboardInterrupt):
    """The stack stopped (Ctrl-C, or its coordinator failed) while this cell waited for a pass."""


@dataclass
class Call:
    """One cell's request for a pass of the vectorised trainer, and its answer."""

    model: torch.nn.Module
    spec: LocalSpec
    data: Split
    task: str
    seed: int
    round: int
    method: str
    result: Any = None
    error: Optional[BaseException] = None
    batches: list = field(default_factory=list)


class _Member:
    def __init__(self, stack: "Stack", index: int):
        self.stack, self.index = stack, index

    def train(self, model, spec, data, task, seed, round, method):
        return self.stack._submit(self.index, Call(model, spec, data, task, seed, round, method))


class Stack:
    """Runs ``jobs`` (one per cell) in threads, one at a time, and trains their passes together.

    ``run`` returns each job's (value, exception). ``passes`` counts the passes trained and
    ``calls`` the cells' requests (what stacking saved); ``on_pass(calls)`` trains the waiting
    calls and returns how many passes it took (default :func:`train_calls`; the flow wraps it in
    a Prefect task)."""

    def __init__(self, on_pass: Optional[Callable[[list[Call]], int]] = None):
        self.on_pass = on_pass or train_calls
        self.cv = threading.Condition()
        self.passes = self.calls = 0

    def run(self, jobs: list[Callable[[], Any]]) -> list[tuple[Any, Optional[BaseException]]]:
        n = len(jobs)
        self.state = ["ready"] * n  # ready | running | waiting | done
        self.pending: list[Optional[Call]] = [None] * n
        self.turn: Optional[int] = None
        self.stopped = False
        out: list = [(None, None)] * n

        def body(i: int, job):
            _local.member = _Member(self, i)
            with self.cv:
                self.cv.wait_for(lambda: self.turn == i or self.stopped)
            try:
                if self.stopped:
                    raise StackStopped("the stack stopped before this cell started")
                out[i] = (job(), None)
            except BaseException as err:  # the cell's own failure is its result; the others go on
                out[i] = (None, err)
            finally:
                with self.cv:
                    self.state[i] = "done"
                    self.cv.notify_all()

        threads = [threading.Thread(target=body, args=(i, job), name=f"flockfl-stack-{i}", daemon=True)
                   for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        try:
            self._coordinate(n)
        except BaseException:
            with self.cv:  # every waiting cell stops where it is (its checkpoints are written)
                self.stopped = True
                for i, call in enumerate(self.pending):
                    if call is not None and self.state[i] == "waiting":
                        call.error = StackStopped("the stack stopped")
                        self.state[i] = "running"
                self.cv.notify_all()
            for t in threads:
                t.join(timeout=60)
            raise
        finally:
            _DATA.clear()  # the merged data is the stack's: its cells' data is freed with them
        for t in threads:
            t.join()
        return out

    def _coordinate(self, n: int) -> None:
        with self.cv:
            while any(s != "done" for s in self.state):
                for i in range(n):  # each ready cell runs until it waits for a pass or ends
                    if self.state[i] == "ready":
                        self.state[i], self.turn = "running", i
                        self.cv.notify_all()
                        self.cv.wait_for(lambda: self.state[i] in ("waiting", "done"))
                waiting = [i for i in range(n) if self.state[i] == "waiting"]
                if not waiting:
                    continue
                calls = [self.pending[i] for i in waiting]
                self.passes += self.on_pass(calls)
                self.calls += len(calls)
                for i in waiting:
                    self.pending[i], self.state[i] = None, "ready"

    def _submit(self, i: int, call: Call):
        with self.cv:
            self.pending[i], self.state[i] = call, "waiting"
            self.cv.notify_all()
            self.cv.wait_for(lambda: (self.state[i] == "running" and self.turn == i) or self.stopped)
        if self.stopped:  # whatever this pass would have been, the cell stops here: a round never goes on without it
            raise call.error if isinstance(call.error, StackStopped) else StackStopped("the stack stopped")
        if call.error is not None:
            raise call.error
        return call.result


# ---------------------------------------------------------------------- merging passes


# Whether passes of convolutional models share one grouped convolution, by device type. On the CPU
# they do not: the convolutions are compute-bound there (NIID-Bench's LeNet-5, 8 cells of 10 clients,
# 2 rounds: 126.0 s stacked against 127.0 s one by one) and a grouped convolution's bits depend on
# its group count, so merging would only trade each cell's exact result for rounding (about a point
# of accuracy after 2 rounds of 94 steps). On a GPU, where a step is launch-bound, they do.
MERGE_CONVOLUTIONS = {"cpu": False}


def share_key(call: Call) -> Optional[tuple]:
    """What passes must have in common to train as one cohort (None: this pass trains alone)."""
    s = call.spec
    if s.solver is not None or len(s.clients) == 0 or call.method not in ("auto", "dense", "stacked", "func"):
        return None
    model = call.model
    if not MERGE_CONVOLUTIONS.get(call.data.x.device.type, True) and convolutional(model):
        return None
    shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in model.named_parameters())
    width = max((len(b) for bs in call.batches for b in bs), default=0)
    sched = (s.lr_schedule, s.lr, call.round if s.lr_schedule.kind == "step" else None)
    extras = (s.momentum, s.weight_decay, s.correction_after_momentum, s.masks is not None, s.snapshot_steps is not None,
              s.momentum_init is not None, tuple(sorted(s.prox_mu.items())) if isinstance(s.prox_mu, dict) else None)
    shared = tuple(k for k, v in s.init.items() if shared_rows(v))  # starts one value for every client (low-rank layers)
    return (type(model), repr(model), shapes, getattr(model, "conv_layout", None), call.task, str(call.data.x.device),
            call.data.x.dtype, tuple(call.data.x.shape[1:]), call.method, width, sched, extras, plain_sgd(s), shared)


def train_calls(calls: list[Call]) -> int:
    """Every call's result (or error): the passes that share a key as one merged pass, the rest
    alone (a merged pass that fails is retried alone, so a failure stays with its cell). Returns
    the number of passes trained."""
    groups: dict[Any, list[Call]] = {}
    for i, call in enumerate(calls):
        call.batches = cohort_schedule(call.spec, call.data.sizes, call.seed, call.round)
        key = share_key(call)
        groups.setdefault(key if key is not None else ("alone", i), []).append(call)
    passes = 0
    for group in groups.values():
        if len(group) > 1:
            try:
                _merged(group)
                passes += 1
                continue
            except Exception:
                pass
        passes += len(group)
        for call in group:
            try:
                sched = stack_schedule(call.batches, call.data.offsets, call.spec.clients)
                call.result = cohort_pass(call.model, call.spec, call.data, call.task, sched,
                                          call.spec.step_rates(call.round, sched.steps), call.method)
            except Exception as err:
                call.error = err
    return passes


_DATA: dict[tuple, tuple[list[Split], Split]] = {}  # the cells' data side by side, kept while the same objects recur


def merged_data(splits: list[Split]) -> Split:
    """The cells' training data back to back (cached by identity: a cell's data changes only
    under a distribution shift)."""
    key = tuple(id(s) for s in splits)
    hit = _DATA.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], splits)):
        return hit[1]
    sizes = np.concatenate([s.sizes for s in splits])
    merged = Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]),
                   np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    if len(_DATA) >= 2:  # a stack's cells keep their data objects: more only under a distribution shift
        _DATA.clear()
    _DATA[key] = (list(splits), merged)
    return merged


def _stack_rows(calls: list[Call], rows: Callable[[LocalSpec], Optional[dict]], fill: Callable) -> Optional[dict]:
    """One per-client field of the merged spec: each cell's rows, or ``fill(like)`` for a cell without them."""
    if all(rows(c.spec) is None for c in calls):
        return None
    keys = next(rows(c.spec) for c in calls if rows(c.spec) is not None).keys()
    out = {}
    for k in keys:
        parts = []
        for c in calls:
            own = rows(c.spec)
            parts.append(own[k] if own is not None else fill(c.spec.init[k]))
        out[k] = torch.cat(parts)
    return out


def _merged(calls: list[Call]) -> None:
    """One pass for ``calls`` (one share key): their cohorts side by side, then each its rows."""
    base = np.cumsum([0] + [len(c.data.sizes) for c in calls])  # cell j's client c is client base[j] + c
    data = merged_data([c.data for c in calls])
    clients = np.concatenate([np.asarray(c.spec.clients, np.int64) + base[j] for j, c in enumerate(calls)])
    batches = [b for c in calls for b in c.batches]
    sched = stack_schedule(batches, data.offsets, clients)
    first = calls[0]
    rates = first.spec.step_rates(first.round, sched.steps)
    bounds = np.cumsum([0] + [len(c.spec.clients) for c in calls])
    segments = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    shared = {k for k, v in first.spec.init.items() if shared_rows(v)}  # the same in every call (the share key)
    init = {k: torch.cat([c.spec.init[k] for c in calls]) for k in first.spec.init}
    client_mu = None
    if not isinstance(first.spec.prox_mu, dict) and len({float(c.spec.prox_mu) for c in calls}) > 1:
        # each cell its own μ (a per-parameter dict is part of the share key)
        mu = torch.cat([torch.full((len(c.spec.clients),), float(c.spec.prox_mu)) for c in calls])
        client_mu = {k: mu for k in init}
    anchor = None
    if any(c.spec.has_prox for c in calls):
        anchor = {k: torch.cat([(c.spec.prox_anchor or c.spec.init)[k] for c in calls]) for k in init}
    spec = dataclasses.replace(
        first.spec, clients=clients, init=init, prox_mu=first.spec.prox_mu if client_mu is None else 0.0,
        client_mu=client_mu, prox_anchor=anchor,
        correction=_stack_rows(calls, lambda s: s.correction, torch.zeros_like),
        momentum_init=_stack_rows(calls, lambda s: s.momentum_init, torch.zeros_like),
        masks=_stack_rows(calls, lambda s: s.masks, torch.ones_like),
        snapshot_steps=(None if first.spec.snapshot_steps is None
                        else np.concatenate([np.asarray(c.spec.snapshot_steps) for c in calls])),
        client_epochs=None, client_steps=None, order=None, pacing=None, meta=None, second=None)
    result = cohort_pass(first.model, spec, data, first.task, sched, rates, first.method, (segments, shared))
    for j, c in enumerate(calls):
        seg = segments[j]
        meta = {k: ({n: t[seg] for n, t in v.items()} if isinstance(v, dict) else v[seg]) for k, v in result.meta.items()
                if k != "momentum_buffer" or c.spec.momentum_init is not None}
        c.result = TrainResult(np.asarray(c.spec.clients), {k: v[seg] for k, v in result.params.items()},
                                result.num_samples[seg], result.num_steps[seg], result.loss[seg], meta)
