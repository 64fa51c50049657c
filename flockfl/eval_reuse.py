"""Evaluation of what changed (``eval.reuse``, issue 33): a client whose model and data did not
change since its last evaluation on a set keeps the metrics it had, instead of running its model
again.

**What is kept.** Per evaluated *set* (a name a call site gives: ``assigned`` for the model each
client is assigned, ``personal`` for Ditto's and pFedMe's personal rows, ``global`` for their
global model) and per client: the fingerprint of the model the client was measured with, and
its per-client values on every test set (mean loss, accuracy, test samples: the
:class:`~flockfl.eval_protocol.ClientMetrics` entries, float64 and int64 as measured). A later
evaluation of the same set takes a client's stored values when the fingerprint of its model now
equals the stored one and the set's *context* is the same: the current data (the distribution
shift's key, :mod:`flockfl.stages.shift`; "" without one), the test sets measured, whether the
model is the client's own, the parameter layout and the device. Anything else is measured, and
stored. The values are the same numbers a measurement gives, so every summary computed from
them is bit-identical; the reuse changes which clients a pass covers, and a client's sums do
not depend on the others in its pass (each row's output is computed from its own inputs, its
sums over its own rows in row order: ``tests/test_eval_reuse.py`` compares runs with and
without reuse bit for bit).

**Fingerprints.** A shared model's (global, cluster, or local training's model per client):
SHA-256 of its tensors' names, shapes, dtypes and bytes, truncated to 128 bits (2 × 64), one
hash per distinct model a pass uses. A personal row's: the SHA-256 digest its
:class:`~flockfl.clientstate.ClientTable` computed when the row was written, truncated the same
way (no hashing at evaluation; ``PersonalModels.own_fingerprints``). Two different models share
a truncated fingerprint with probability about 2⁻¹²⁸ (SHA-256's output is uniform; nothing
adversarial chooses the weights): a false reuse is far less likely than a hardware error. A
method whose evaluated models are computed otherwise (a mixture with the global model, an
adaptation step, fine-tuned or pruned models, a shared body under personal heads) changes them
every round and is measured as before.

**Resume.** The store travels in the checkpoint (``state.driver.eval_reuse``, outside the
state's digest), so a resumed run reuses exactly what the uninterrupted one would.
``eval.reuse=false`` measures every client every time (and keeps no store).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from flockfl.eval_protocol import ClientMetrics, label_union_applies

if TYPE_CHECKING:
    from flockfl.context import RunContext

FP_BYTES = 16  # 2 × 64 bits of SHA-256


def model_fingerprint(params: dict[str, torch.Tensor]) -> np.ndarray:
    """[16] uint8: SHA-256 of one model's tensors (sorted names, shapes, dtypes, bytes), truncated."""
    h = hashlib.sha256()
    for k in sorted(params):
        v = params[k].detach()
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
        h.update(memoryview(v.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return np.frombuffer(h.digest()[:FP_BYTES], np.uint8).copy()


def shared_fingerprints(models: dict[str, torch.Tensor], which: np.ndarray) -> np.ndarray:
    """[len(which), 16]: the fingerprint of model ``which[i]`` of the stacked ``models``, one hash per distinct model."""
    uniq, inverse = np.unique(np.asarray(which, np.int64), return_inverse=True)
    fps = np.zeros((len(uniq), FP_BYTES), np.uint8)
    for i, j in enumerate(uniq):
        fps[i] = model_fingerprint({k: v[int(j)] for k, v in models.items()})
    return fps[inverse.reshape(-1)]


class EvalReuse:
    """The stored per-client values of every evaluated set, and what this evaluation did
    (``counts``: clients ``measured`` and ``reused``, per set too)."""

    def __init__(self, sets: Optional[dict] = None):
        self.sets: dict[str, dict[str, Any]] = sets or {}
        self.counts: dict[str, int] = {"measured": 0, "reused": 0}

    # ------------------------------------------------------------------ the checkpointed form
    @classmethod
    def restore(cls, payload: Optional[dict]) -> "EvalReuse":
        """From ``state.driver.eval_reuse`` (:meth:`payload`; new arrays: the state is not changed)."""
        if not payload:
            return cls()
        array = lambda dtype, raw: np.frombuffer(raw, np.dtype(dtype)).copy()  # noqa: E731
        return cls({name: {"context": s["context"], "fp": array("uint8", s["fp"]).reshape(-1, FP_BYTES),
                           "has": array("bool", s["has"]),
                           "values": {ts: tuple(array(d, raw) for d, raw in triple) for ts, triple in s["values"].items()}}
                    for name, s in payload.items()})

    def payload(self) -> dict:
        """Plain values (strings and bytes: a driver record compares with ``==``)."""
        return {name: {"context": s["context"], "fp": s["fp"].tobytes(), "has": s["has"].tobytes(),
                       "values": {ts: [(a.dtype.str, a.tobytes()) for a in triple] for ts, triple in s["values"].items()}}
                for name, s in self.sets.items()}

    # ------------------------------------------------------------------ lookup and store
    def _set(self, name: str, context: str, n: int) -> dict[str, Any]:
        s = self.sets.get(name)
        if s is None or s["context"] != context or len(s["has"]) != n:  # another data or layout: nothing holds
            s = self._empty(name, context, n)
        return s

    def _empty(self, name: str, context: str, n: int) -> dict[str, Any]:
        """Set ``name`` anew: no client stored."""
        s = self.sets[name] = {"context": context, "fp": np.zeros((n, FP_BYTES), np.uint8), "has": np.zeros(n, bool),
                               "values": {}}
        return s

    def measure(self, name: str, context: str, num_clients: int, clients: np.ndarray, fps: np.ndarray,
                run: Callable[[np.ndarray], ClientMetrics]) -> ClientMetrics:
        """The listed clients' metrics on set ``name``: the stored values where a client's
        fingerprint ``fps[i]`` equals its stored one, ``run(positions)`` (the metrics of
        ``clients[positions]``, measured) for the rest, which are then stored."""
        clients = np.asarray(clients, np.int64)
        s = self._set(name, context, num_clients)
        hit = s["has"][clients] & (s["fp"][clients] == fps).all(1)
        miss = np.flatnonzero(~hit)
        fresh = run(miss) if len(miss) else None
        if fresh is not None and s["values"] and set(fresh.sets) != set(s["values"]):
            # other test sets than those stored (the context names them: not expected): measure all
            s = self._empty(name, context, num_clients)
            miss = np.arange(len(clients))
            fresh = run(miss)
        self._count(name, len(miss), len(clients) - len(miss))
        if fresh is None:
            return ClientMetrics({ts: tuple(a[clients] for a in arrays) for ts, arrays in s["values"].items()})
        out = {}
        for ts, triple in fresh.sets.items():
            arrays = s["values"].setdefault(ts, tuple(np.zeros(num_clients, np.asarray(a).dtype) for a in triple))
            for a, b in zip(arrays, triple):
                a[clients[miss]] = b
            out[ts] = tuple(a[clients] for a in arrays)
        s["fp"][clients[miss]] = fps[miss]
        s["has"][clients[miss]] = True
        return ClientMetrics(out)

    def _count(self, name: str, measured: int, reused: int) -> None:
        for key, n in (("measured", measured), ("reused", reused)):
            self.counts[key] += n
            self.counts[f"{name}/{key}"] = self.counts.get(f"{name}/{key}", 0) + n


def context_key(ctx: RunContext, own: bool, params: dict[str, torch.Tensor]) -> str:
    """What a set's stored values hold under besides the models: the current data (the shift's
    key), the test sets measured, own or shared models, the parameter layout and the device."""
    sets = ["proportional"] + (["label_union"] if ctx.data.task == "classification"
                               and label_union_applies(ctx.cfg, own) else [])
    layout = sorted((k, tuple(v.shape[1:]), str(v.dtype)) for k, v in params.items())
    device = next(iter(params.values())).device if params else "cpu"
    return repr((getattr(ctx, "_shift_key", ""), ctx.data is ctx.base_data, sets, own, layout, str(device)))


def active(ctx: RunContext) -> Optional[EvalReuse]:
    """The run's store while the driver evaluates with ``eval.reuse`` on; None otherwise."""
    return getattr(ctx, "eval_reuse", None)


def measure_shared_reused(ctx: RunContext, name: str, models: dict[str, torch.Tensor], which: np.ndarray,
                          clients: np.ndarray, measure_shared: Callable) -> ClientMetrics:
    """``measure_shared`` (:func:`flockfl.evaluation.measure_shared`, passed in: evaluation imports
    this module), reusing what did not change (set ``name``)."""
    store = active(ctx)
    which = np.maximum(np.asarray(which, np.int64), 0)
    clients = np.asarray(clients, np.int64)
    if store is None:
        return measure_shared(ctx, models, which, clients)
    return store.measure(name, context_key(ctx, False, models), ctx.num_clients, clients,
                         shared_fingerprints(models, which), lambda pos: measure_shared(ctx, models, which[pos], clients[pos]))


def measure_own_reused(ctx: RunContext, name: str, clients: np.ndarray, fps: Optional[np.ndarray],
                       build: Callable[[np.ndarray], dict[str, torch.Tensor]], layout: dict[str, torch.Tensor],
                       measure_own: Callable) -> ClientMetrics:
    """:func:`flockfl.evaluation.measure_own` of ``build(positions)`` (the stacked models of
    ``clients[positions]``), built only for the clients whose fingerprint ``fps`` changed (all,
    without a store or without fingerprints). ``layout``: stacked tensors of the models' names,
    shapes (after the first axis) and dtypes, e.g. ``state.models``; ``measure_own``:
    :func:`flockfl.evaluation.measure_own`."""
    store = active(ctx)
    clients = np.asarray(clients, np.int64)
    if store is None or fps is None:
        return measure_own(ctx, build(np.arange(len(clients))), clients)
    return store.measure(name, context_key(ctx, True, layout), ctx.num_clients, clients, fps,
                         lambda pos: measure_own(ctx, build(pos), clients[pos]))
