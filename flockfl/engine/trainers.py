"""The two local trainers: a plain per-client reference loop and the vectorised cohort trainer.

Both take a :class:`LocalSpec` and the materialised client data, follow the same batch
schedule, and return a :class:`TrainResult`. Tests assert that they agree to 1e-5. The probe
that picks one of them (``train.engine=auto``) is :mod:`flockfl.engine.probe`; the thread and
device set-up, :mod:`flockfl.engine.runtime`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from flockfl.engine.bn import calibrate_bn, calibrate_bn_loop  # noqa: F401 (re-exported: the callers' import)
from flockfl.engine.data import Split
from flockfl.engine.dense import DenseCohort, LowRankWeight, dense_layers, low_rank
from flockfl.engine.functional import per_sample_loss, stack, stacked_plan, stacked_step
from flockfl.engine.schedule import LocalSpec, cohort_schedule, restrict, stack_schedule
from flockfl.engine.update import GradientTerms


# the stack cell (flockfl.engine.stacking) this thread runs, if any: its passes go to the stack
CELL = threading.local()


@dataclass
class TrainResult:
    clients: np.ndarray
    params: dict[str, torch.Tensor]  # stacked final parameters
    num_samples: np.ndarray  # n_i
    num_steps: np.ndarray  # local steps actually taken
    loss: np.ndarray  # mean training loss over the local steps
    meta: dict = field(default_factory=dict)

    @property
    def raw_params(self) -> dict:
        """``params`` as the trainer left them: a low-rank layer's weight may still be its factors
        (:class:`LowRankWeight`), which :func:`flockfl.aggregation.weighted_mean` reduces without
        writing out. Reading ``params`` writes them out (once)."""
        return self.__dict__["_params"]

    def finite(self) -> torch.Tensor:
        """[clients] bool: whether every parameter of each client is finite (a factored weight is
        checked on its factors, :meth:`LowRankWeight.finite`)."""
        n = len(self.clients)
        # a sum is non-finite iff some entry is (inf − inf gives nan): one read, no mask tensor
        return torch.stack([v.finite() if isinstance(v, LowRankWeight) else torch.isfinite(v.reshape(n, -1).sum(1))
                            for v in self.raw_params.values()]).all(0)

    @staticmethod
    def concat(parts: list["TrainResult"]) -> "TrainResult":
        parts = [p for p in parts if len(p.clients)]
        if len(parts) == 1:
            return parts[0]
        meta: dict = {}
        for p in parts:
            for k, v in p.meta.items():
                meta.setdefault(k, []).append(v)
        return TrainResult(
            np.concatenate([p.clients for p in parts]),
            {k: _cat_stacked([p.raw_params[k] for p in parts]) for k in parts[0].raw_params},
            np.concatenate([p.num_samples for p in parts]),
            np.concatenate([p.num_steps for p in parts]),
            np.concatenate([p.loss for p in parts]),
            {k: _concat_meta(v) for k, v in meta.items()},
        )

    def reorder(self, order: np.ndarray) -> "TrainResult":
        """The rows in ``order`` (the cohort's order again after passes by length)."""
        idx = torch.as_tensor(order, dtype=torch.long)
        rows = lambda v: v[idx.to(v.device)] if isinstance(v, torch.Tensor) else v[order]  # noqa: E731
        meta = {k: ({n: rows(t) for n, t in v.items()} if isinstance(v, dict)
                    else rows(v) if isinstance(v, (np.ndarray, torch.Tensor)) else v) for k, v in self.meta.items()}
        return TrainResult(self.clients[order], {k: rows(v) for k, v in self.params.items()}, self.num_samples[order],
                           self.num_steps[order], self.loss[order], meta)


def _cat_stacked(values: list) -> "torch.Tensor | LowRankWeight":
    """The shards' stacked values of one parameter as the cohort's: factored weights stay factored
    where :meth:`LowRankWeight.cat` can join them; anything else is written out and concatenated."""
    joined = LowRankWeight.cat(values)
    if joined is not None:
        return joined
    return torch.cat([v.dense() if isinstance(v, LowRankWeight) else v for v in values])


def _params(self) -> dict[str, torch.Tensor]:
    raw = self.__dict__["_params"]
    if any(isinstance(v, LowRankWeight) for v in raw.values()):
        raw = self.__dict__["_params"] = {k: v.dense() if isinstance(v, LowRankWeight) else v for k, v in raw.items()}
    return raw


def _set_params(self, value: dict) -> None:
    self.__dict__["_params"] = value


# stacked final parameters, written out when first read (a dataclass field with a property: the
# generated __init__, replace and pickling all go through it)
TrainResult.params = property(_params, _set_params)


def _concat_meta(parts: list):
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if isinstance(parts[0], dict):  # stacked tensors (the pruning snapshot, masks)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return parts


def solved(model: nn.Module, spec: LocalSpec, data: Split, task: str, vectorized: bool = False) -> TrainResult:
    """The result of a local solver (no steps, no training loss). A solver returns the stacked
    parameters, or (parameters, meta): stacked per-client extras (pFedMe's θ̃_i) that ride in
    ``TrainResult.meta`` and are concatenated across shards like the parameters. The vectorised
    trainer runs ``spec.solver_vectorized`` where the algorithm gives one (the same update for
    the whole cohort at once; tests hold it to the per-client ``spec.solver``)."""
    fn = spec.solver_vectorized if vectorized and spec.solver_vectorized is not None else spec.solver
    out = fn(model, spec, data, task)
    params, meta = out if isinstance(out, tuple) else (out, {})
    n = len(spec.clients)
    return TrainResult(np.asarray(spec.clients), params, data.sizes[spec.clients], np.zeros(n, np.int64), np.zeros(n),
                       dict(meta))


def stat_names(model: nn.Module) -> list[str]:
    """Entries of the parameter dict that are state, not trained (BN statistics), in the
    model's order: neither trainer steps them; :func:`calibrate_bn` sets them after training."""
    return [n for n, p in model.named_parameters() if not p.requires_grad]


@contextlib.contextmanager
def training(model: nn.Module):
    """The model in training mode for a block (BatchNorm on the batch's statistics), then back
    in the mode it was in (the driver keeps it in evaluation mode between rounds)."""
    was = model.training
    model.train()
    try:
        yield model
    finally:
        model.train(was)


def _snapshot_at(spec: LocalSpec, steps_taken: np.ndarray) -> np.ndarray | None:
    """The step after which each client's snapshot is taken (its last step if it takes fewer)."""
    if spec.snapshot_steps is None:
        return None
    return np.minimum(np.asarray(spec.snapshot_steps), steps_taken)


def train_reference(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int, round: int) -> TrainResult:
    """Plain PyTorch: one model copy per client, SGD step by step."""
    if spec.solver is not None:
        return solved(model, spec, data, task)
    batches = cohort_schedule(spec, data.sizes, seed, round)
    frozen = stat_names(model)
    snap_at = _snapshot_at(spec, np.array([len(b) for b in batches]))
    finals, losses, snaps, buffers = [], [], [], []
    for ci, cid in enumerate(spec.clients):
        net = copy.deepcopy(model)
        net.train()
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(spec.init[name][ci])
        x_c, y_c = data.client(int(cid))
        anchor = {n: (spec.prox_anchor or spec.init)[n][ci] for n, _ in net.named_parameters()}
        buf = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
        if spec.momentum_init is not None:  # train.optimizer_state=persist: where the client's last round left it
            buf.update({n: spec.momentum_init[n][ci].to(buf[n]).clone() for n in spec.momentum_init})
        total = 0.0
        snap = {n: p.detach().clone() for n, p in net.named_parameters()} if snap_at is not None and snap_at[ci] == 0 else None
        rates = spec.step_rates(round, len(batches[ci]))
        stepped = [(n, p) for n, p in net.named_parameters() if n not in frozen]  # once per client, not per step
        after = bool(spec.momentum) and spec.correction_after_momentum  # where the correction enters
        for s, local in enumerate(batches[ci]):
            idx = torch.from_numpy(local)
            net.zero_grad(set_to_none=True)
            loss = per_sample_loss(net(x_c[idx]), y_c[idx], task).mean()
            loss.backward()
            with torch.no_grad():
                for n, p in stepped:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    if spec.weight_decay:
                        g = g + spec.weight_decay * p
                    if spec.mu_of(n):
                        g = g + spec.mu_of(n) * (p - anchor[n])
                    if spec.correction is not None and not after:
                        g = g + spec.correction[n][ci]
                    if spec.momentum:
                        buf[n] = spec.momentum * buf[n] + g
                        g = buf[n]
                    if spec.correction is not None and after:
                        g = g + spec.correction[n][ci]
                    if spec.masks is not None and n in spec.masks:
                        g = g * spec.masks[n][ci]
                    p.sub_(rates[s] * g)
            total += float(loss.detach())
            if snap_at is not None and s + 1 == snap_at[ci]:
                snap = {n: p.detach().clone() for n, p in net.named_parameters()}
        finals.append({n: p.detach().clone() for n, p in net.named_parameters()})
        if spec.momentum_init is not None:
            buffers.append({n: buf[n] for n in spec.momentum_init})
        if snap_at is not None:
            snaps.append(snap if snap is not None else finals[-1])
        losses.append(total / max(len(batches[ci]), 1))
    params = stack(finals)
    calibrate_bn(model, params, data, spec.clients)
    meta = {"snapshot": stack(snaps)} if snap_at is not None and snaps else {}
    if spec.momentum_init is not None:
        meta["momentum_buffer"] = stack(buffers) if buffers else {k: v.clone() for k, v in spec.momentum_init.items()}
    return TrainResult(
        np.asarray(spec.clients), params, data.sizes[spec.clients],
        np.array([len(b) for b in batches]), np.array(losses), meta,
    )


def train_cohort(model: nn.Module, spec: LocalSpec, data: Split, task: str, seed: int, round: int,
                 method: str = "auto") -> TrainResult:
    """All clients at once: parameters stacked on a leading axis, one batched step for all.

    ``method``: ``dense`` (hand-written in-place step for Linear/ReLU stacks, see
    :mod:`flockfl.engine.dense`), ``func`` (``vmap(grad)`` of ``functional_call``, any
    model), or ``auto`` (dense where the model allows it). Clients of unequal size are
    handled as data: padded batch slots have weight 0 and a client with no step left gets
    a zero gradient.
    """
    if spec.solver is not None:
        return solved(model, spec, data, task, vectorized=True)
    cell = getattr(CELL, "member", None)
    if cell is not None:  # a cell of a stack: its cohort trains with the other cells' (flockfl.engine.stacking)
        return cell.train(model, spec, data, task, seed, round, method)
    sched = stack_schedule(cohort_schedule(spec, data.sizes, seed, round), data.offsets, spec.clients)
    return cohort_pass(model, spec, data, task, sched, spec.step_rates(round, sched.steps), method)


def convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def plain_sgd(spec: LocalSpec, rates: list[float] = ()) -> bool:
    """Whether the dense trainer's SGD may take the pass: one η, and no extra term but SCAFFOLD's
    additive correction (no prox, momentum, weight decay, mask or snapshot)."""
    only_correction = spec.correction is not None and not (spec.has_prox or spec.momentum or spec.weight_decay)
    return (not spec.has_extras or only_correction) and spec.masks is None and spec.snapshot_steps is None \
        and len(set(rates)) <= 1


def _low_rank(model: nn.Module, spec: LocalSpec, rates: list[float], method: str, batch: int) -> bool:
    """Whether the pass takes the dense trainer with low-rank layers (FedAvg's MLP; not MCLR's 10
    outputs): one product as long as the pass, one GEMM over all rows, other bits in a shorter pass."""
    layers = dense_layers(model) if method in ("auto", "dense") and plain_sgd(spec, rates) else None
    return layers is not None and low_rank(spec.init, layers, batch)


def length_buckets(steps: np.ndarray) -> list[np.ndarray] | None:
    """Clients of very unequal schedules (a power-law partition: FlexCFL's synthetic data, 2 to 1,000
    steps) trained in passes of similar length: every step of a pass computes every client of it,
    stopped or not, so one pass of 100 clients whose longest takes 1,000 steps does 100,000 client-
    steps for a few thousand taken. Buckets halve in length (each pass's clients take more than half
    its steps), and only where padding would be more than half the work: None keeps one pass. Each
    client's arithmetic is its own in a dense or linear stack (per-client batched products, the same
    padded width), so its bits do not change; convolutional models keep one pass (a grouped
    convolution's bits depend on its group count), and so does a dense stack from a shared start
    (its low-rank layers: see :func:`_low_rank`)."""
    n = len(steps)
    if n < 2 or steps.max() * n <= 2 * max(int(steps.sum()), 1):
        return None
    order = np.argsort(-steps, kind="stable")
    buckets, start = [], 0
    for i in range(1, n + 1):
        if i == n or steps[order[i]] * 2 <= steps[order[start]]:
            buckets.append(np.sort(order[start:i]))
            start = i
    return buckets if len(buckets) > 1 else None


def cohort_pass(model: nn.Module, spec: LocalSpec, data: Split, task: str, sched, rates: list[float],
                method: str = "auto", segments: tuple[list[slice], set[str]] | None = None) -> TrainResult:
    """:func:`train_cohort`'s pass over a stacked schedule ``sched`` with step rates ``rates``, in
    passes by length where the clients' schedules are very unequal (:func:`length_buckets`).
    ``segments``: where the cohort is the cohorts of several cells (:mod:`flockfl.engine.stacking`),
    their slices of the client axis and the entries each cell's clients start from one value of
    (a dense stack keeps that shared start per segment, as each cell alone would)."""
    shared = bool(segments and segments[1])
    if not shared and not convolutional(model) and not _low_rank(model, spec, rates, method, sched.index.shape[2]):
        buckets = length_buckets(sched.active.sum(0).numpy())
        if buckets is not None:
            parts = [_one_pass(model, restrict(spec, pos), data, task, sched.rows(pos), rates, method) for pos in buckets]
            return TrainResult.concat(parts).reorder(np.argsort(np.concatenate(buckets), kind="stable"))
    return _one_pass(model, spec, data, task, sched, rates, method, segments if shared else None)


def _one_pass(model: nn.Module, spec: LocalSpec, data: Split, task: str, sched, rates: list[float],
              method: str = "auto", segments: tuple[list[slice], set[str]] | None = None) -> TrainResult:
    device = data.x.device
    # the dense trainer takes plain SGD steps with one η for the whole pass
    plain = plain_sgd(spec, rates)
    layers = dense_layers(model) if method in ("auto", "dense") and plain else None
    steps = sched.active.sum(0).numpy()
    if method == "dense" and layers is None:
        raise ValueError("method='dense' needs a Flatten/Linear/ReLU stack, a constant rate within the pass and no "
                         "prox/momentum/weight-decay/mask/snapshot terms")
    snap_at = _snapshot_at(spec, steps)
    meta: dict = {}
    index, weight = sched.index.to(device), sched.weight.to(device)
    total = torch.zeros(len(spec.clients), device=device)
    if layers is not None:
        # keep broadcast inits broadcast (a shared start enables the low-rank layers)
        init = {k: (v[:1].to(device).expand_as(v) if v.stride(0) == 0 else v.to(device)) for k, v in spec.init.items()}
        corr = None if spec.correction is None else {k: v.to(device) for k, v in spec.correction.items()}
        cohort = DenseCohort(init, layers, rates[0] if rates else spec.lr, index.shape[2], segments, sched.steps, corr)
        active = sched.active.to(device) if corr is not None else None
        for s in range(sched.steps):
            total += cohort.step(data.x[index[s]], data.y[index[s]], weight[s], task, None if active is None else active[s])
        params = cohort.params(factored=True)
    else:
        params = {k: v.to(device).clone(memory_format=torch.contiguous_format) for k, v in spec.init.items()}
        frozen = stat_names(model)
        step = cohort_step(model, task, method)
        extras = GradientTerms(spec, params, device)
        masks = {k: v.to(device) for k, v in spec.masks.items()} if spec.masks is not None else {}
        snap = {k: v.clone() for k, v in params.items()} if snap_at is not None else None
        full = (sched.weight > 0).flatten(1).all(1).tolist()  # steps with no padded slot (BN fused), read on the CPU
        # which clients step, on the device once; whether all do, read on the CPU (no device sync a step)
        active, everyone = sched.active.to(device), sched.active.all(1).tolist()
        with training(model):
            for s in range(sched.steps):
                g, loss = step(params, data.x[index[s]], data.y[index[s]], weight[s], full[s])
                with torch.no_grad():
                    extras.update(params, g, active[s], everyone[s], rates[s], masks, frozen)
                    if snap is not None:
                        rows = torch.from_numpy(np.flatnonzero(snap_at == s + 1)).to(device)
                        if len(rows):
                            for k in params:
                                snap[k][rows] = params[k][rows]
                total += loss.detach()
        calibrate_bn(model, params, data, spec.clients)
        if snap is not None:
            meta["snapshot"] = snap
    if spec.momentum_init is not None:  # persist: each client's final buffer (its start, where it takes no momentum)
        buf = extras.buf if layers is None and extras.buf is not None else None
        meta["momentum_buffer"] = {k: buf[k] if buf is not None else spec.momentum_init[k].to(device).clone()
                                   for k in spec.momentum_init}
    return TrainResult(
        np.asarray(spec.clients), params, data.sizes[spec.clients], steps,
        (total.cpu().numpy() / np.maximum(steps, 1)), meta,
    )


def cohort_step(model: nn.Module, task: str, method: str = "auto"):
    """``step(params, x, y, w, full=None) → (gradients, losses)`` for parameters stacked on a leading
    client axis and a [C, B] batch with per-sample weights ``w`` (1/batch size, 0 for padding;
    ``full``: whether no slot is padded, a hint the stacked path's BN uses): the
    stacked convolution plan where the model has one (``auto``/``stacked``), else ``vmap`` of
    ``grad_and_value`` over ``functional_call``. BN statistics are taken over the real samples
    only; frozen entries (BN statistics) get a zero gradient (stacked) or their autograd one,
    which the callers never apply."""
    frozen = stat_names(model)
    weighted = getattr(model, "takes_sample_weight", False)  # BN: batch statistics over real samples only

    def weighted_loss(p, x, y, w):
        out = functional_call(model, p, (x,), {"sample_weight": w}) if weighted else functional_call(model, p, (x,))
        return (per_sample_loss(out, y, task) * w).sum()

    plan = stacked_plan(model) if method in ("auto", "stacked") else None
    if method == "stacked" and plan is None:
        raise ValueError("method='stacked' needs a Sequential of Conv2d/ReLU/MaxPool2d/Flatten/Linear or a ConvBNNet")
    if plan is not None:
        return stacked_step(model, plan, task, frozen)
    batched = vmap(grad_and_value(weighted_loss))
    return lambda p, x, y, w, full=None: batched(p, x, y, w)


TRAINERS = {"reference": train_reference, "vectorized": train_cohort}
