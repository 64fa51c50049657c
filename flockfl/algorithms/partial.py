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

import numpy as np
import torch
from torch import nn

from flockfl.aggregation import broadcast, weighted_mean
from flockfl.algorithms.personal import Personal, trained_names
from flockfl.algorithms.hyper import Hyper
from flockfl.clientstate import ClientTable
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


class PartialSharing(Personal):
    """FedAvg on the shared layers; the personal layers (``personal_spec``) stay on each client."""

    # the partition key this method declares, and whether it names the personal part (False:
    # it names the shared part, LG-FedAvg's global_layers)
    layers_key = "personal_layers"
    key_names_personal = True
    keeps_rows = True  # FedBABU keeps no per-client state

    # ------------------------------------------------------------------ the round
    def local_spec(self, state, ctx, clients, round):
        """FedAvg's spec, each client starting from the shared layers + its personal rows."""
        spec = super().local_spec(state, ctx, clients, round)
        spec.init = self.start_models(state, ctx, clients)
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        """The weighted mean of the shared layers; the trained clients' rows (every column of the
        client table: the personal layers, and whatever else a subclass keeps there) to the table."""
        kept = set(self.kept_names(state))
        shared = {k: v for k, v in result.params.items() if k not in kept}
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
        kept = set(self.kept_names(state))
        per = sum(v[0].numel() * v.element_size() for k, v in state.models.items() if k not in kept)
        return len(clients) * per, len(clients) * per

    # ------------------------------------------------------------------ the split
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

    def names(self, state) -> list[str]:
        """The personal layers (fixed at ``init_state``)."""
        return list(state.meta["personal_layers"])

    def kept_names(self, state) -> list[str]:
        """The layers this round keeps off the server (the personal ones; LG-FedAvg's warm start: none)."""
        return self.names(state)

    # ------------------------------------------------------------------ state
    def init_state(self, ctx):
        state = super().init_state(ctx)
        state = state.replace(meta={**state.meta, "personal_layers": self.personal_names(ctx.model)})
        return self.start_rows(state, ctx)

    def start_rows(self, state, ctx):
        """The round-0 state's client rows: the personal layers at the init (none for FedBABU)."""
        names = self.names(state)
        if not names or not self.keeps_rows:
            return state
        return state.replace(algo={"personal": ClientTable(ctx.num_clients, {k: state.models[k][0] for k in names})})

    def own_models(self, state, ctx, clients, assign):
        """Shared layers (broadcast) + each client's personal rows (the init for a client never seen)."""
        clients = np.asarray(clients, np.int64)
        n = len(clients)
        out = broadcast(state.models, n)
        if "personal" in state.algo:
            out.update(state.algo["personal"].gather(clients, next(iter(state.models.values())).device))
        return out

    def start_models(self, state, ctx, clients):
        """Where a round's local training starts: the client's own model."""
        return self.own_models(state, ctx, clients, np.zeros(len(clients), np.int64))

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the shared layers + the init personal layers"
