"""A hand-written cohort trainer for dense stacks (Flatten → Linear/ReLU … → Linear).

``vmap(grad)`` materialises a fresh per-client gradient for every weight at every step and
then a fresh updated copy: for W1 (120 clients of MLP 784-200-10) that is two new 75 MB
tensors per step, and the trainer becomes memory-bound, no faster than a Python loop.
For Linear/ReLU stacks the backward pass is short enough to write out, and two things
remove that traffic:

- **dense layers** keep one weight per client and apply W ← W − η·δᵀa in place with one
  ``baddbmm_`` per step (no allocation);
- **low-rank layers**: when every client starts from the same weight W₀ (FedAvg, FedSGD),
  client c's weight after s steps is W₀ − η Σ_{t<s} δ_tᵀ a_t, a rank-(s·B) correction of a
  shared matrix. The layer keeps W₀ once plus the factors (δ_t, a_t); the forward pass is
  one shared GEMM a·W₀ᵀ minus (a·A_tᵀ)·D_t through B×R Gram products, and the per-client
  weight is written once, at the end. A layer switches to dense mode when its rank would
  pass half its smaller dimension (beyond that the factors cost more than the matrix).

MCLR, the MLP and linear regression take this path; anything else uses torch.func. Tests
check both against the per-client reference loop.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def dense_layers(model: nn.Module) -> list[str] | None:
    """Parameter-name prefixes of the Linear layers if ``model`` is a dense stack, else None."""
    if not isinstance(model, nn.Sequential):
        return None
    names, mods = [], list(model.named_children())
    for i, (name, m) in enumerate(mods):
        if isinstance(m, nn.Linear):
            names.append(name)
        elif isinstance(m, nn.Flatten) and i == 0:
            continue
        elif not isinstance(m, nn.ReLU):
            return None
    if not names or not isinstance(mods[-1][1], nn.Linear):
        return None
    relu_after = [isinstance(mods[i + 1][1], nn.ReLU) for i, (_, m) in enumerate(mods[:-1]) if isinstance(m, nn.Linear)]
    return names if all(relu_after) else None  # every hidden Linear is followed by a ReLU


def shared_rows(t: torch.Tensor) -> bool:
    """True if a stacked tensor is one value broadcast over its leading (client) axis."""
    return t.dim() > 0 and t.shape[0] > 0 and t.stride(0) == 0


def max_rank(weight: torch.Tensor, batch: int) -> int:
    """The largest rank a low-rank layer of this [C, out, in] weight keeps (half its smaller
    dimension, whole steps of ``batch``); below ``batch`` the layer is dense from the start."""
    return (min(weight.shape[1], weight.shape[2]) // 2) // batch * batch


def low_rank(init: dict[str, torch.Tensor], layers: list[str], batch: int) -> bool:
    """Whether any layer of a dense stack starting at ``init`` trains in low-rank mode: a shared
    start (one weight broadcast over the clients) with room for a step's rank."""
    return any(shared_rows(w) and max_rank(w, batch) >= batch for w in (init[f"{n}.weight"] for n in layers))


class _Layer:
    """One Linear layer of the cohort: weight = base − η·Dᵀ·A (factors only in low-rank mode).
    ``segments`` (cells trained together, :mod:`flockfl.engine.stacking`): slices of the client
    axis, each with its own shared start; each segment's shared GEMM is the one it would run alone."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], max_rank: int, batch: int, lr: float,
                 segments: Optional[list[slice]] = None, shared: Optional[bool] = None,
                 drift: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None):
        """``drift``: a constant per-client term g_c added to every gradient (SCAFFOLD's c − c_i), for
        the weight and the bias: client c's weight after s active steps is base − η·Dᵀ·A − η·s·g_c."""
        c, out, inp = weight.shape
        self.lr = lr
        self.bias = None if bias is None else bias.clone(memory_format=torch.contiguous_format)
        self.drift, self.bias_drift = drift if drift is not None else (None, None)
        self.count = weight.new_zeros(c) if self.drift is not None else None  # each client's active steps so far
        self.segments = segments or [slice(0, c)]
        self.lowrank = (shared_rows(weight) if shared is None else shared) and max_rank >= batch
        if self.lowrank:
            self.bases = [weight[seg.start] for seg in self.segments]  # [out, in] each, shared by its segment
            self.A = weight.new_empty(c, max_rank, inp)
            self.D = weight.new_empty(c, max_rank, out)
            self.rank = 0
        else:
            self.base = weight.clone(memory_format=torch.contiguous_format)  # [C, out, in]

    def _shared_gemm(self, a: torch.Tensor, transpose: bool) -> torch.Tensor:
        """a·baseᵀ (forward) or a·base (input gradient), each segment with its own base."""
        def one(part, base):
            return (part.reshape(-1, part.shape[-1]) @ (base.T if transpose else base)).reshape(
                part.shape[0], part.shape[1], -1)

        if len(self.segments) == 1:
            return one(a, self.bases[0])
        out = a.new_empty(a.shape[0], a.shape[1], self.bases[0].shape[0 if transpose else 1])
        for seg, base in zip(self.segments, self.bases):
            out[seg] = one(a[seg], base)
        return out

    def _drifted(self, out: torch.Tensor, a: torch.Tensor, transpose: bool) -> torch.Tensor:
        """``out`` − η·s_c·(a·g_cᵀ) (forward) or − η·s_c·(a·g_c) (input gradient): the drift the
        low-rank weight has taken so far, never written into it."""
        if self.drift is not None and self.lowrank and bool(self.count.any()):
            t = torch.bmm(a, self.drift.transpose(1, 2) if transpose else self.drift)
            out.sub_(t.mul_((self.lr * self.count).reshape(-1, 1, 1)))
        return out

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.lowrank:
            z = self._shared_gemm(a, True)
            if self.rank:
                gram = torch.bmm(a, self.A[:, : self.rank].transpose(1, 2))  # [C, B, R]
                z.baddbmm_(gram, self.D[:, : self.rank], alpha=-self.lr)
            self._drifted(z, a, True)
        else:
            z = torch.bmm(a, self.base.transpose(1, 2))
        if self.bias is not None:
            z += self.bias.unsqueeze(1)
        return z

    def backward_input(self, delta: torch.Tensor) -> torch.Tensor:
        """δ·W with the weight as it was at this step's forward pass."""
        if self.lowrank:
            g = self._shared_gemm(delta, False)
            if self.rank:
                gram = torch.bmm(delta, self.D[:, : self.rank].transpose(1, 2))
                g.baddbmm_(gram, self.A[:, : self.rank], alpha=-self.lr)
            return self._drifted(g, delta, False)
        return torch.bmm(delta, self.base)

    def update(self, delta: torch.Tensor, a: torch.Tensor, active: Optional[torch.Tensor] = None) -> None:
        """W ← W − η·(δᵀa + g_c); b ← b − η·(Σδ + g_c) (g_c: the drift, only for the clients still
        stepping, ``active``; δ of a client with no step left is 0)."""
        step = None if self.drift is None else (active.to(self.count.dtype) if active is not None
                                                else torch.ones_like(self.count))
        if self.bias is not None:
            self.bias.sub_(delta.sum(1), alpha=self.lr)
            if self.bias_drift is not None:
                self.bias.sub_(self.bias_drift * step.unsqueeze(1), alpha=self.lr)
        if self.lowrank:
            b = delta.shape[1]
            if self.rank + b > self.A.shape[1]:
                self.to_dense()
            else:
                self.A[:, self.rank : self.rank + b] = a
                self.D[:, self.rank : self.rank + b] = delta
                self.rank += b
                if step is not None:
                    self.count += step
                return
        self.base.baddbmm_(delta.transpose(1, 2), a, alpha=-self.lr)
        if step is not None:
            self.base.sub_(self.drift * step.reshape(-1, 1, 1), alpha=self.lr)

    def to_dense(self) -> None:
        if self.lowrank:
            w = torch.cat([base.expand(seg.stop - seg.start, *base.shape) for seg, base in zip(self.segments, self.bases)])
            if self.rank:
                w.baddbmm_(self.D[:, : self.rank].transpose(1, 2), self.A[:, : self.rank], alpha=-self.lr)
            if self.drift is not None:
                w.sub_(self.drift * (self.lr * self.count).reshape(-1, 1, 1))
            self.base, self.lowrank = w, False
            del self.A, self.D

    def weight(self) -> torch.Tensor:
        self.to_dense()
        return self.base

    def result(self) -> "torch.Tensor | LowRankWeight":
        """The layer's final stacked weight: the factors themselves where it is still low-rank with
        one shared start (written out only when read, :class:`LowRankWeight`), else the dense one."""
        if self.lowrank and self.rank and len(self.segments) == 1:
            drift = None if self.drift is None else (self.drift, self.count)
            return LowRankWeight(self.bases[0], self.D[:, : self.rank], self.A[:, : self.rank], self.lr, drift)
        return self.weight()


def _norm(t: torch.Tensor) -> torch.Tensor:
    """[C]: each client's Frobenius norm of a stacked tensor (one reduction pass: 8 ms for W1's
    75 MB where an absolute maximum takes 44–52). A NaN or inf gives a non-finite norm, and so
    may finite entries past 1e19 (their float32 squares): the caller then checks exactly."""
    return torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1).double()


def _rows_of_one(tensors) -> torch.Tensor:
    """Stacked tensors concatenated along their first axis: as a view where they are consecutive
    rows of one contiguous tensor (shards sliced from it), else copied."""
    tensors = list(tensors)
    t0 = tensors[0]
    offset, ptr, consecutive = t0.storage_offset(), t0.untyped_storage().data_ptr(), True
    for t in tensors:
        consecutive &= (t.is_contiguous() and t.untyped_storage().data_ptr() == ptr and t.storage_offset() == offset
                        and t.shape[1:] == t0.shape[1:] and t.dtype == t0.dtype)
        offset += t.numel()
    if not consecutive:
        return torch.cat(tensors)
    shape = (sum(len(t) for t in tensors), *t0.shape[1:])
    strides = [1] * len(shape)  # C order, written out: a one-row part's own first stride may be anything
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return t0.as_strided(shape, strides, t0.storage_offset())


class LowRankWeight:
    """A stacked [C, out, in] weight held as its factors: client c's weight is base − η·D_cᵀ·A_c
    (a low-rank layer's clients, all from one shared start). :meth:`dense` writes it out with
    the bits of :meth:`_Layer.to_dense`; :meth:`weighted_mean` reduces it without writing it:
    Σ_c w_c·base − η·(Σ_c w_c·D_cᵀA_c) is one GEMM over all clients' factors, [out, C·R] @
    [C·R, in] (W1: 17 ms against 60 ms to write 120 dense weights and 14 ms to average them)."""

    def __init__(self, base: torch.Tensor, D: torch.Tensor, A: torch.Tensor, lr: float,
                 drift: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """``drift``: (g [C, out, in], s [C]): each client's constant gradient term and its steps
        (SCAFFOLD's correction), so that client c's weight is base − η·D_cᵀA_c − η·s_c·g_c."""
        self.base, self.D, self.A, self.lr = base, D, A, lr
        self.drift = drift

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.D.shape[0], *self.base.shape))

    def __len__(self) -> int:
        return self.D.shape[0]

    @property
    def device(self) -> torch.device:
        return self.D.device

    def dense(self) -> torch.Tensor:
        if self.drift is None:
            w = torch.cat([self.base.expand(*self.shape)])
        else:  # base − η·s_c·g_c in one pass more than the plain write-out, no temporary
            g, steps = self.drift
            w = torch.mul(g, (-self.lr * steps).reshape(-1, 1, 1)).add_(self.base)
        return w.baddbmm_(self.D.transpose(1, 2), self.A, alpha=-self.lr)

    def weighted_mean(self, w: torch.Tensor) -> torch.Tensor:
        """Σ_c w_c·(base − η·D_cᵀA_c), as :func:`flockfl.aggregation.weighted_mean` of the
        written-out weight up to rounding."""
        w = w.to(device=self.D.device, dtype=self.D.dtype)
        dw = (self.D * w.view(-1, 1, 1)).reshape(-1, self.D.shape[-1])  # [C·R, out]
        mean = torch.addmm(self.base * w.sum(), dw.T, self.A.reshape(-1, self.A.shape[-1]), alpha=-self.lr)
        if self.drift is not None:  # − η Σ_c w_c s_c g_c: one matrix-vector product
            g, steps = self.drift
            mean.sub_(((w * steps) @ g.reshape(len(self), -1)).reshape(mean.shape), alpha=self.lr)
        return mean

    def gradient_sum(self, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[C, out, in]: Σ_t g_t of each client, its gradients summed over its steps (D_cᵀA_c; the
        drift left out), times ``scale`` ([C], one per client) if given, applied to the small
        factor D rather than to the product (no pass over the cohort-sized result); a new tensor."""
        d = self.D if scale is None else self.D * scale.to(self.D).reshape(-1, 1, 1)
        return torch.bmm(d.transpose(1, 2), self.A)

    @staticmethod
    def cat(parts: list) -> "Optional[LowRankWeight]":
        """The shards' factored weights as one (the cohort's clients in shard order), or None where
        they cannot be: different starts, rates or ranks, or a drift in some only. The factors are
        concatenated (W1's 120 clients: 3.8 MB against 75 MB written out); each client's product is
        its own in the batched GEMM, so :meth:`dense` gives the bits the shards' would. Drifts that
        are consecutive rows of one tensor (the shards' slices of SCAFFOLD's c − c_i, in this process)
        are taken back as that tensor's rows, not copied: 10,000 clients, 1,000 a round in shards of
        256, wrote out and concatenated 1.2 GB a round before."""
        first = parts[0]
        if not all(isinstance(p, LowRankWeight) for p in parts):
            return None
        same = all(p.lr == first.lr and p.D.shape[1:] == first.D.shape[1:] and p.A.shape[1:] == first.A.shape[1:]
                   and (p.drift is None) == (first.drift is None) and p.D.device == first.D.device
                   and p.D.dtype == first.D.dtype
                   and (p.base is first.base or torch.equal(p.base, first.base)) for p in parts[1:])
        if not same:
            return None
        drift = None
        if first.drift is not None:
            drift = (_rows_of_one(p.drift[0] for p in parts), torch.cat([p.drift[1] for p in parts]))
        return LowRankWeight(first.base, torch.cat([p.D for p in parts]), torch.cat([p.A for p in parts]), first.lr,
                             drift)

    def finite(self) -> torch.Tensor:
        """[C] bool: whether each client's weight is finite, read off the factors. Finite factors
        give a finite weight unless max|base| + η·‖D_c‖·‖A_c‖ (+ η·s_c·‖g_c‖) could pass float's
        range; such clients (none in a sane run) are written out and checked entry by entry."""
        # |(D_cᵀA_c)_ij| = |Σ_r D_ri A_rj| ≤ ‖D_c‖_F·‖A_c‖_F (Cauchy–Schwarz), and |g_ij| ≤ ‖g_c‖_F
        bound = self.base.abs().amax().double() + abs(self.lr) * _norm(self.D) * _norm(self.A)
        if self.drift is not None:
            g, steps = self.drift
            bound = bound + abs(self.lr) * steps.double() * _norm(g)
        ok = torch.isfinite(bound) & (bound < torch.finfo(self.D.dtype).max / 2)
        unsure = torch.nonzero(~ok).flatten()  # a NaN, an inf or a norm past float's range: checked exactly
        if len(unsure):
            drift = None if self.drift is None else (self.drift[0][unsure], self.drift[1][unsure])
            part = LowRankWeight(self.base, self.D[unsure], self.A[unsure], self.lr, drift).dense()
            ok[unsure] = torch.isfinite(part.reshape(len(unsure), -1)).all(1)
        return ok


class DenseCohort:
    """SGD for a cohort of dense stacks, one call to :meth:`step` per local step."""

    def __init__(self, init: dict[str, torch.Tensor], layers: list[str], lr: float, batch: int,
                 segments: Optional[tuple[list[slice], set[str]]] = None, steps: Optional[int] = None,
                 correction: Optional[dict[str, torch.Tensor]] = None):
        """``segments``: (the cells' slices of the client axis, the entries each starts shared)
        where the cohort is several cells' (:mod:`flockfl.engine.stacking`). ``steps``: the pass's
        length where known: a low-rank layer keeps room for that many steps' factors only (then
        they fill it, and the mean on them reads them in place: W1's 19 MB copy less a round).
        ``correction``: a constant per-client term added to every gradient (SCAFFOLD's c − c_i,
        stacked like ``init``); a low-rank layer keeps it beside its factors, never written in."""
        self.names = layers
        self.layers = []
        for name in layers:
            w = init[f"{name}.weight"]
            cap = max_rank(w, batch) if steps is None else min(max_rank(w, batch), steps * batch)
            drift = None
            if correction is not None:
                drift = (correction[f"{name}.weight"].contiguous(), None if f"{name}.bias" not in correction
                         else correction[f"{name}.bias"].contiguous())
            seg = (segments[0], f"{name}.weight" in segments[1]) if segments else (None, None)
            self.layers.append(_Layer(w, init.get(f"{name}.bias"), cap, batch, lr, *seg, drift=drift))

    @torch.no_grad()
    def step(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, task: str,
             active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [C, B, ...], y: [C, B], w: [C, B] per-sample weights (1/batch, 0 for padding);
        ``active``: [C] bool, the clients taking this step (the correction moves only them; None:
        all). Returns each client's weighted loss before the step."""
        acts = [x.reshape(x.shape[0], x.shape[1], -1)]
        for i, layer in enumerate(self.layers):
            z = layer.forward(acts[-1])
            acts.append(z.clamp_min_(0) if i < len(self.layers) - 1 else z)
        out = acts.pop()
        if task == "regression":
            diff = out.squeeze(-1) - y
            loss = (diff * diff * w).sum(1)
            delta = (2 * diff * w).unsqueeze(-1)
        else:
            logp = torch.log_softmax(out, -1)
            loss = (-logp.gather(-1, y.unsqueeze(-1)).squeeze(-1) * w).sum(1)
            delta = logp.exp_()
            delta.scatter_add_(-1, y.unsqueeze(-1), -torch.ones_like(y, dtype=delta.dtype).unsqueeze(-1))
            delta *= w.unsqueeze(-1)
        # backward: every layer's input-δ uses the weight of this step, before its update
        for i in range(len(self.layers) - 1, -1, -1):
            layer, a = self.layers[i], acts[i]
            nxt = None
            if i > 0:
                nxt = layer.backward_input(delta)
                nxt *= a > 0  # ReLU'(z), read off the stored activation
            layer.update(delta, a, active)
            delta = nxt
        return loss

    def params(self, factored: bool = False) -> dict[str, "torch.Tensor | LowRankWeight"]:
        """The cohort's stacked parameters; ``factored``: low-rank weights as their factors
        (:class:`LowRankWeight`, for :class:`flockfl.engine.TrainResult` to write out when read)."""
        out = {}
        for name, layer in zip(self.names, self.layers):
            out[f"{name}.weight"] = layer.result() if factored else layer.weight()
            if layer.bias is not None:
                out[f"{name}.bias"] = layer.bias
        return out


@torch.no_grad()
def dense_forward(models: dict[str, torch.Tensor], layers: list[str], x: torch.Tensor) -> torch.Tensor:
    """Outputs of k stacked dense models on shared inputs x [N, ...]: returns [k, N, out]."""
    a = x.reshape(1, x.shape[0], -1)
    for i, name in enumerate(layers):
        wt, b = models[f"{name}.weight"], models.get(f"{name}.bias")
        a = torch.matmul(a, wt.transpose(1, 2))
        if b is not None:
            a += b.unsqueeze(1)
        if i < len(layers) - 1:
            a.clamp_min_(0)
    return a
