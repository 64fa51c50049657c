"""The personalised family's common part: each client is measured with its own model.

Two siblings build on :class:`Personal`:

- :class:`~flockfl.algorithms.partial.PartialSharing` (FedPer, LG-FedAvg, FedRep, FedBABU,
  FedBN): some layers are averaged by the server, the others stay on the client;
- :class:`PersonalModels` (Ditto, APFL, pFedMe, Per-FedAvg): a whole personal model per client
  beside the global model, which is plain FedAvg.

Both keep per-client rows in a :class:`~flockfl.clientstate.ClientTable`
(``state.algo['personal']``): a round gathers and scatters only its cohort's rows. What they
share lives here: the chunked evaluation of every client's own model (``train.eval_chunk``
clients at a time; ``accuracy`` and ``accuracy_personal``, plus any family a subclass adds in
``chunk_metrics``) and the per-client gradient of the plain loops (:func:`gradient`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from flockfl.aggregation import broadcast
from flockfl.algorithms.base import Algorithm
from flockfl.clientstate import ClientTable, chunks
from flockfl.engine.functional import per_sample_loss
from flockfl.engine.trainers import stat_names, training
from flockfl.eval_protocol import ClientMetrics, family, overlay, protocol
from flockfl.eval_reuse import FP_BYTES, measure_own_reused, measure_shared_reused
from flockfl.evaluation import client_results, measure_own, measure_shared


class Personal(Algorithm):
    """A method whose clients keep their own models: each is evaluated with its ``own_models``
    row, a chunk of clients at a time."""

    family = "personalised"
    personal = True

    def chunk_metrics(self, state, ctx, clients: np.ndarray, assign: np.ndarray) -> dict[str, ClientMetrics]:
        """Per-client metrics of one chunk, per family suffix ('' = the personal model)."""
        return {"": measure_own(ctx, self.own_models(state, ctx, clients, assign), clients)}

    def evaluate(self, state, ctx) -> dict[str, Any]:
        clients, task = ctx.seen, ctx.data.task
        assign = self.eval_assignment(state, ctx)
        parts = [self.chunk_metrics(state, ctx, part, assign[part]) for part in chunks(clients, self.cfg.train.eval_chunk)]
        per = {s: ClientMetrics.join(p[s] for p in parts) for s in parts[0]}
        out = client_results(ctx, per[""], assign, lambda t: self.cluster_metrics(state, ctx, clients, assign[clients], *t))
        proto = protocol(ctx)
        out.update(family(per[""], proto, task, "_personal"))
        for s, cm in per.items():
            if s:
                out.update(family(cm, proto, task, s))
        return out


def gradient(model: nn.Module, names: list[str], task: str) -> Callable[[dict, Any, Any], dict]:
    """``grad(params, x, y)``: the gradient of the mean loss on (x, y) w.r.t. the parameters
    ``names`` (one client, plain PyTorch; the per-client loops of APFL, Per-FedAvg and pFedMe). A
    parameter the forward pass does not use gets a zero gradient, as in the reference trainer."""

    def grad(p: dict, x, y) -> dict:
        with torch.enable_grad(), training(model):
            leaves = {k: p[k].detach().requires_grad_(True) for k in names}
            loss = per_sample_loss(functional_call(model, {**p, **leaves}, (x,)), y, task).mean()
            grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
            return {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, grads)}

    return grad


def trained_names(model: nn.Module, keys) -> list[str]:
    """The keys that SGD trains (not BatchNorm statistics)."""
    frozen = set(stat_names(model))
    return [k for k in keys if k not in frozen]


class PersonalModels(Personal):
    """A whole personal model per client beside the global model, which is plain FedAvg (Ditto,
    APFL, pFedMe; Per-FedAvg keeps none, or its last local models under ``eval_model=last_local``). The personal models are rows of
    a :class:`ClientTable` (``state.algo['personal']``; a client never seen uses the current
    global w); ``local_spec`` puts the cohort's new rows in ``spec.meta['personal']`` and
    ``aggregate`` writes those of the clients that trained. Everything travels as in FedAvg."""

    keeps_rows = True
    # ``own_models`` gives a client never trained exactly the global w (its row's model part is
    # w, ``personal_rows``), so ``chunk_metrics`` measures those clients with the one shared pass.
    # A subclass whose evaluation model is computed otherwise (APFL's α-mixture, Per-FedAvg's
    # adaptation step) sets it False and every client is measured with its own model.
    unwritten_rows_are_global = True

    def extra_row(self) -> dict[str, torch.Tensor]:
        """Per-client values kept beside the model (APFL's α_i)."""
        return {}

    def init_state(self, ctx):
        state = super().init_state(ctx)
        state = state.replace(meta={**state.meta, "personal_layers": []})
        if not self.keeps_rows:
            return state
        row = {**{k: v[0] for k, v in state.models.items()}, **self.extra_row()}
        return state.replace(algo={"personal": ClientTable(ctx.num_clients, row)})

    def personal_rows(self, state, clients) -> dict[str, torch.Tensor]:
        """The listed clients' rows; the model part is the current w for a client never seen."""
        clients = np.asarray(clients, np.int64)
        device = next(iter(state.models.values())).device
        rows = state.algo["personal"].gather(clients, device)
        fresh = torch.from_numpy(~state.algo["personal"].written(clients)).to(device)
        glob = broadcast(state.models, len(clients))
        return {k: torch.where(fresh.reshape(-1, *[1] * (v.dim() - 1)), glob[k], v) if k in glob else v
                for k, v in rows.items()}

    def own_models(self, state, ctx, clients, assign):
        rows = self.personal_rows(state, clients)
        return {k: rows[k] for k in state.models}

    def aggregate(self, state, ctx, spec, result, assign):
        """w: FedAvg (the base); the trained clients' new rows to the table."""
        new = super().aggregate(state, ctx, spec, result, assign)
        return self.keep_rows(new, state, spec, result)

    def keep_rows(self, new, state, spec, result):
        """``new`` with the trained clients' rows written (:meth:`new_rows`)."""
        if not self.keeps_rows:
            return new
        rows = self.new_rows(state, spec, result)
        return new.replace(algo={**state.algo, "personal": state.algo["personal"].scatter(result.clients, rows)})

    def new_rows(self, state, spec, result) -> dict[str, torch.Tensor]:
        """The trained clients' new rows, in result order: the shards' second pass, or rows the
        driver computed (``spec.meta['personal']``, in cohort order)."""
        if "personal" in result.meta:  # computed in the train shards (spec.second), in result order
            return result.meta["personal"]
        pos = {int(c): i for i, c in enumerate(spec.clients)}
        idx = torch.tensor([pos[int(c)] for c in result.clients], dtype=torch.long)
        return {k: v[idx.to(v.device)] for k, v in spec.meta["personal"].items()}

    def chunk_metrics(self, state, ctx, clients, assign):
        """The personal models, and (``_global``) the global model: one pass for every client.
        A client never trained has the global w as its personal model (``personal_rows``), so
        its personal metrics are its global ones: only the written rows are measured one model
        each (a 10,000-client population trained 1,000 a round has mostly such clients)."""
        glob = measure_shared_reused(ctx, "global", state.models, np.zeros(len(clients), np.int64), clients,
                                     measure_shared)
        if not self.unwritten_rows_are_global or "personal" not in state.algo:
            return {"": measure_own(ctx, self.own_models(state, ctx, clients, assign), clients), "_global": glob}
        mine = np.flatnonzero(state.algo["personal"].written(clients))
        own = (measure_own_reused(ctx, "personal", clients[mine], self.own_fingerprints(state, clients[mine]),
                                  lambda pos: self.own_models(state, ctx, clients[mine][pos], assign[mine][pos]),
                                  state.models, measure_own) if len(mine) else None)
        return {"": overlay(glob, mine, own), "_global": glob}

    def own_fingerprints(self, state, clients) -> Optional[np.ndarray]:
        """[len(clients), 16] fingerprints of the written personal rows ``own_models`` gives these
        clients: their table digests (computed when the rows were written), truncated
        (:mod:`flockfl.eval_reuse`); None (measure them all) for a subclass whose ``own_models``
        computes the evaluated models otherwise."""
        if type(self).own_models is not PersonalModels.own_models:
            return None
        table = state.algo["personal"]
        return np.stack([np.frombuffer(table.digest(int(c))[:FP_BYTES], np.uint8) for c in clients])

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global w (an unwritten personal row)"
