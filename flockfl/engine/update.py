"""The vectorised trainer's local step after the gradients: the extra terms (weight decay, FedProx's
μ(w − anchor), SCAFFOLD's correction, local momentum, masks) and the SGD update, for parameters
stacked on the client axis, in the reference loop's order. In one pass over memory where
:mod:`flockfl.engine.fused` can run, else eager; the same bits either way."""

from __future__ import annotations

import torch

from flockfl.engine import fused
from flockfl.engine.schedule import LocalSpec


def client_mask(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-client 0/1 flag (clients still stepping) as ``like``'s dtype, broadcast over the
    trailing dimensions of a tensor stacked on the client axis."""
    return active.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


class GradientTerms:
    """Weight decay ω·w, FedProx's μ(w − anchor), an additive per-client correction and local
    momentum, in the reference loop's order, for stacked parameters. Clients with no step left
    (``active`` false) neither move nor advance their momentum."""

    def __init__(self, spec: LocalSpec, params: dict[str, torch.Tensor], device):
        self.spec = spec
        self.any = spec.has_extras
        self.anchor = {k: v.to(device) for k, v in (spec.prox_anchor or spec.init).items()} if spec.has_prox else None
        self.mu = None if spec.client_mu is None else {
            k: v.to(device, params[k].dtype).reshape(-1, *([1] * (params[k].dim() - 1))) for k, v in spec.client_mu.items()}
        self.corr = {k: v.to(device) for k, v in spec.correction.items()} if spec.correction is not None else None
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()} if spec.momentum else None
        if self.buf is not None and spec.momentum_init is not None:  # persist: each client's buffer from its last round
            self.buf.update({k: v.to(device, params[k].dtype).clone() for k, v in spec.momentum_init.items()})
        self.after = self.buf is not None and spec.correction_after_momentum  # where the correction enters

    def update(self, params, g, active, everyone: bool, rate: float, masks: dict, frozen) -> None:
        """One step's SGD update of every trained parameter, in place: ``p -= rate · (g + terms) · masks``.
        In one pass (:mod:`flockfl.engine.fused`) where it can run, else eager, one tensor operation
        per term; both the same operations in the same order, so the same bits."""
        fuse = self.buf is None and fused.available()
        for k, gk in g.items():
            if k in frozen:
                continue
            if fuse and fused.supported(params[k], gk):
                mu = self._mu(k)
                fused.sgd_update(params[k], gk, rate, weight_decay=self.spec.weight_decay if self.any else 0.0,
                                 anchor=self.anchor[k] if mu is not None else None, mu=mu,
                                 correction=self.corr[k] if self.corr is not None else None,
                                 client_mask=None if everyone or not self.any else active, mask=masks.get(k))
                continue
            gk = self.terms(k, params, gk, active, everyone) if self.any else _owned(gk)
            if k in masks:
                gk.mul_(masks[k])
            params[k].sub_(gk.mul_(rate))

    def _mu(self, k: str):
        """FedProx's μ of parameter ``k`` (one per client in stacked cells), None where it has none."""
        if self.anchor is None:
            return None
        if self.mu is not None and k in self.mu:
            return self.mu[k]
        return self.spec.mu_of(k) or None

    def terms(self, k: str, params, gk, active, everyone: bool):
        """Parameter ``k``'s gradient with the terms added, in place where the gradient is the step's own
        (each ``a + b`` becomes ``a.add_(b)``: the same operations in the same order, the same
        bits, without a cohort-sized temporary per term); ``× mask`` only where a client stopped."""
        gk = _owned(gk)
        if self.spec.weight_decay:
            gk.add_(self.spec.weight_decay * params[k])
        mu = self._mu(k)
        if mu is not None:
            gk.add_(torch.sub(params[k], self.anchor[k]).mul_(mu))
        if self.corr is not None and not self.after:
            gk.add_(self.corr[k])
        if self.buf is not None:
            mask = client_mask(active, gk)
            self.buf[k] = mask * (self.spec.momentum * self.buf[k] + gk) + (1 - mask) * self.buf[k]
            gk = self.buf[k].clone()  # the caller scales it in place: not the buffer itself
        if self.corr is not None and self.after:
            gk.add_(self.corr[k])
        return gk if everyone else gk.mul_(client_mask(active, gk))


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it can be updated in place (a gradient computed for this step), else a copy
    (an expanded or otherwise non-contiguous view)."""
    return t if t.is_contiguous() and t.stride()[-1:] != (0,) else t.contiguous().clone()
