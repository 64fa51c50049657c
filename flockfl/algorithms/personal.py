"""Partial sharing: some layers are averaged by the server, the others ("personal") stay on
the client. One mechanism for FedPer, LG-FedAvg, FedRep, FedBABU and FedBN.

**Which layers.** A partition spec names a set of parameters, resolved against the model's
module structure (never name substrings):

- ``none`` / ``all``;
- ``head``: the last ``nn.Linear`` (its weight and bias);
- ``top:k`` / ``bottom:k``: the last / first k weight-bearing modules (Conv*, Linear), in
  registration (= forward) order;
- ``bn``: every BatchNorm module's parameters **and** statistics (``WeightedBatchNorm2d`` keeps
  its running mean/var as non-trained parameters, so they are in ``named_parameters``);
- otherwise comma-separated parameter-name prefixes (``fc3.,bn1.``), as IFCA's ``shared``.

**State.** ``state.models`` is one model: its shared layers are the server's average, its
personal layers stay at the seeded init (what a client never seen starts from). Each client's
personal layers live in a :class:`~flockfl.clientstate.ClientTable` (``state.algo['personal']``,
default row = the init): a round gathers and scatters only its cohort's rows. Nothing personal
is uploaded, so ``comm_bytes`` counts the shared layers only.

**Evaluation.** Each client with its own model (shared + its personal rows), in chunks of
``train.eval_chunk``: ``accuracy`` (``_min``, ``_p10``) and ``accuracy_personal`` (the same).
The "global" model (shared + init personal layers) is not a model anyone uses, so it is not
reported (FedBABU, whose head is the init by design, adds ``accuracy_global``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from flockfl.aggregation import broadcast, weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import Hyper
from flockfl.client import run_engine
from flockfl.clientstate import ClientTable, chunks
from flockfl.engine import TRAINERS
from flockfl.engine.schedule import LocalSpec, restrict
from flockfl.engine.trainers import TrainResult
from flockfl.engine.functional import per_sample_loss
from flockfl.engine.trainers import stat_names, training
from flockfl.eval_protocol import ClientMetrics, family, overlay, protocol
from flockfl.evaluation import client_results, measure_own, measure_shared
from models import WeightedBatchNorm2d, build_model

WEIGHTED = (nn.modules.conv._ConvNd, nn.Linear)


PARTITIONS = "none, all, head, bn, top:k, bottom:k (Conv/Linear layers) or parameter-name prefixes 'fc3.,bn1.'"


def partition_key(name: str, default: str, meaning: str, symbol: str) -> Hyper:
    """A partition key (checked against the model in ``check_config``)."""
    return Hyper(name, default, f"{meaning}: {PARTITIONS}", symbol, "text")


def _is_bn(m: nn.Module) -> bool:
    return isinstance(m, (nn.modules.batchnorm._BatchNorm, WeightedBatchNorm2d))


def resolve_layers(model: nn.Module, spec: str, key: str = "algorithm.personal_layers") -> list[str]:
    """The parameter names ``spec`` selects, in the model's order; ValueError (one line) for a bad spec."""
    names = [n for n, _ in model.named_parameters()]
    spec = str(spec).strip()

    def owned_by(mods: list[str]) -> list[str]:
        return [n for n in names if any(n.startswith(m + ".") for m in mods)]

    weighted = [name for name, m in model.named_modules() if isinstance(m, WEIGHTED)]
    if spec == "none":
        return []
    if spec == "all":
        return names
    if spec == "head":
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError(f"{key}: 'head' needs a Linear layer and this model has none")
        return owned_by(linears[-1:])
    if spec == "bn":
        return owned_by([name for name, m in model.named_modules() if _is_bn(m)])
    if spec.startswith(("top:", "bottom:")):
        side, _, k = spec.partition(":")
        if not k.isdigit() or not 0 <= int(k) <= len(weighted):
            raise ValueError(f"{key}: {spec!r} needs 0 ≤ k ≤ {len(weighted)} (the model's Conv/Linear layers "
                             f"{', '.join(weighted)}), e.g. top:2")
        k = int(k)
        return owned_by(weighted[len(weighted) - k:] if side == "top" else weighted[:k])
    prefixes = [p.strip() for p in spec.split(",")]
    if any(not p for p in prefixes):
        raise ValueError(f"{key}: {spec!r} has an empty prefix; give none, all, head, bn, top:k, bottom:k "
                         "or parameter-name prefixes like 'fc3.,bn1.'")
    unknown = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if unknown:
        raise ValueError(f"{key}: {', '.join(map(repr, unknown))} matches no parameter (the model has "
                         f"{', '.join(names)}); give none, all, head, bn, top:k, bottom:k or name prefixes")
    return [n for n in names if any(n.startswith(p) for p in prefixes)]


def frozen_masks(params: dict[str, torch.Tensor], names: list[str], n: int) -> dict[str, torch.Tensor]:
    """0-masks (stacked for ``n`` clients, broadcast views) that keep the listed parameters fixed."""
    return {k: torch.zeros((1, *params[k].shape[1:]), dtype=params[k].dtype, device=params[k].device)
            .expand(n, *params[k].shape[1:]) for k in names}


def run_pass(ctx, state, spec: LocalSpec, round: int) -> TrainResult:
    """One extra pass of local training (FedRep's head epochs, FedBABU's fine-tuning), with the
    run's trainer and sharded like a round (``train.shard_size``)."""
    t, trainer = ctx.cfg.train, TRAINERS[run_engine(ctx.cfg, state)]
    n = len(spec.clients)
    return TrainResult.concat([trainer(ctx.model, restrict(spec, slice(a, min(n, a + t.shard_size))), ctx.data.train,
                                       ctx.data.task, ctx.seed, round) for a in range(0, n, t.shard_size)])


class PartialSharing(Algorithm):
    """FedAvg on the shared layers; the personal layers (``personal_spec``) stay on each client."""

    family = "personalised"

    personal = True
    # the partition key this method declares, and whether it names the personal part (False:
    # it names the shared part, LG-FedAvg's global_layers)
    layers_key = "personal_layers"
    key_names_personal = True

    @classmethod
    def check_config(cls, cfg) -> None:
        """The layer spec must name layers of this model, and leave something personal and
        something shared: otherwise the method is another one (FedAvg, or local training), and
        a run under its name would compare that method under the wrong label."""
        model = build_model(cfg.model.name, (1, 28, 28), 2, cfg.model.hidden)
        spec = getattr(cfg.algorithm, cls.layers_key, None)
        if spec is not None:
            resolve_layers(model, spec, f"algorithm.{cls.layers_key}")
        trained = trained_names(model, [n for n, _ in model.named_parameters()])
        personal = set(cls(cfg).personal_names(model))
        key = cls.split_key(cfg)
        if not personal & set(trained):
            raise ValueError(f"{key} leaves no trained layer personal on model {cfg.model.name}: {cls.name} would be "
                             f"FedAvg; {cls.degenerate_fix(cfg, 'personal')}")
        if not set(trained) - personal:
            raise ValueError(f"{key} makes every trained layer of model {cfg.model.name} personal: {cls.name} would be "
                             f"local training (algorithm.name=local); {cls.degenerate_fix(cfg, 'shared')}")

    @classmethod
    def split_key(cls, cfg) -> str:
        """The ``key=value`` that decides the split into personal and shared layers."""
        return f"algorithm.{cls.layers_key}={getattr(cfg.algorithm, cls.layers_key)}"

    @classmethod
    def degenerate_fix(cls, cfg, missing: str) -> str:
        """What to change when the split leaves nothing ``missing`` ('personal' or 'shared')."""
        return f"set algorithm.{cls.layers_key} to leave some layers {missing} (e.g. head, top:1, bottom:1)"

    def personal_names(self, model: nn.Module) -> list[str]:
        chosen = resolve_layers(model, self.hp(self.layers_key), f"algorithm.{self.layers_key}")
        if self.key_names_personal:
            return chosen
        return [n for n, _ in model.named_parameters() if n not in set(chosen)]

    # ------------------------------------------------------------------ state
    def init_state(self, ctx):
        state = super().init_state(ctx)
        names = self.personal_names(ctx.model)
        meta = {**state.meta, "personal_layers": names}
        if not names or not self.keeps_rows:
            return state.replace(meta=meta)
        table = ClientTable(ctx.num_clients, {k: state.models[k][0] for k in names})
        return state.replace(meta=meta, algo={"personal": table})

    keeps_rows = True  # FedBABU keeps no per-client state

    def names(self, state) -> list[str]:
        return list(state.meta["personal_layers"])

    def own_models(self, state, ctx, clients, assign):
        """Shared layers (broadcast) + each client's personal rows (the init for a client never seen)."""
        clients = np.asarray(clients, np.int64)
        n = len(clients)
        out = broadcast(state.models, n)
        if "personal" in state.algo:
            out.update(state.algo["personal"].gather(clients, next(iter(state.models.values())).device))
        return out

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        spec.init = self.own_models(state, ctx, clients, np.zeros(len(clients), np.int64))
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        """The weighted mean of the shared layers; the trained clients' rows (every column of the
        client table: the personal layers, and whatever else a subclass keeps there) to the table."""
        names = set(self.names(state))
        shared = {k: v for k, v in result.params.items() if k not in names}
        models = {k: v.clone() for k, v in state.models.items()}
        if shared:
            mean = weighted_mean(shared, self.weights(result, np.arange(len(result.clients))))
            for k in shared:
                models[k][0] = mean[k]
        new = self._with_assignments(state, models, result.clients, assign)
        if "personal" in state.algo:
            table = state.algo["personal"]
            rows = {k: result.params[k] for k in table.order}
            new = new.replace(algo={**state.algo, "personal": table.scatter(result.clients, rows)})
        return new

    def comm_bytes(self, state, clients):
        """Only the shared layers travel, each way."""
        names = set(self.names(state))
        per = sum(v[0].numel() * v.element_size() for k, v in state.models.items() if k not in names)
        return len(clients) * per, len(clients) * per

    # ------------------------------------------------------------------ evaluation
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

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the shared layers + the init personal layers"


# ---------------------------------------------------------------------- a whole personal model per client


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


class PersonalModels(PartialSharing):
    """A whole personal model per client beside the global model, which is plain FedAvg (Ditto,
    APFL, pFedMe; Per-FedAvg keeps none, or its last local models under ``eval_model=last_local``). The personal models are rows of
    a :class:`ClientTable` (``state.algo['personal']``; a client never seen uses the current
    global w); ``local_spec`` puts the cohort's new rows in ``spec.meta['personal']`` and
    ``aggregate`` writes those of the clients that trained. Everything travels as in FedAvg."""

    layers_key = ""
    keeps_rows = True
    # ``own_models`` gives a client never trained exactly the global w (its row's model part is
    # w, ``personal_rows``), so ``chunk_metrics`` measures those clients with the one shared pass.
    # A subclass whose evaluation model is computed otherwise (APFL's α-mixture, Per-FedAvg's
    # adaptation step) sets it False and every client is measured with its own model.
    unwritten_rows_are_global = True

    @classmethod
    def check_config(cls, cfg) -> None:
        pass

    def extra_row(self) -> dict[str, torch.Tensor]:
        """Per-client values kept beside the model (APFL's α_i)."""
        return {}

    def init_state(self, ctx):
        state = Algorithm.init_state(self, ctx)
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
        new = Algorithm.aggregate(self, state, ctx, spec, result, assign)
        return self.keep_rows(new, state, spec, result)

    def keep_rows(self, new, state, spec, result):
        if not self.keeps_rows:
            return new
        if "personal" in result.meta:  # computed in the train shards (spec.personal_pass), in result order
            rows = result.meta["personal"]
        else:  # computed on the driver, in cohort order
            pos = {int(c): i for i, c in enumerate(spec.clients)}
            idx = torch.tensor([pos[int(c)] for c in result.clients], dtype=torch.long)
            rows = {k: v[idx.to(v.device)] for k, v in spec.meta["personal"].items()}
        return new.replace(algo={**state.algo, "personal": state.algo["personal"].scatter(result.clients, rows)})

    def comm_bytes(self, state, clients):
        return Algorithm.comm_bytes(self, state, clients)

    def chunk_metrics(self, state, ctx, clients, assign):
        """The personal models, and (``_global``) the global model: one pass for every client.
        A client never trained has the global w as its personal model (``personal_rows``), so
        its personal metrics are its global ones: only the written rows are measured one model
        each (a 10,000-client population trained 1,000 a round has mostly such clients)."""
        glob = measure_shared(ctx, state.models, np.zeros(len(clients), np.int64), clients)
        if not self.unwritten_rows_are_global or "personal" not in state.algo:
            return {"": measure_own(ctx, self.own_models(state, ctx, clients, assign), clients), "_global": glob}
        mine = np.flatnonzero(state.algo["personal"].written(clients))
        own = (measure_own(ctx, self.own_models(state, ctx, clients[mine], assign[mine]), clients[mine])
               if len(mine) else None)
        return {"": overlay(glob, mine, own), "_global": glob}
