"""Which parameters are which: a model's parameters as one flat vector and FedAC's split of it
into the embedding φ and the decision h (``algorithm.decision_layers``); the parameters IFCA's
cluster models share (``algorithm.shared``) and their storage as one tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from flockfl.aggregation import flatten, unflatten
from flockfl.errors import ConfigError
from models import build_model


@dataclass(frozen=True)
class Layout:
    """How a model's parameters lie in one flat vector, and which of them are φ and h."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # start of each parameter; offsets[-1] = dim
    embedding: tuple[str, ...]  # φ
    decision: tuple[str, ...]  # h

    @property
    def dim(self) -> int:
        return self.offsets[-1]

    @property
    def like(self) -> dict[str, torch.Tensor]:
        """One (storage-less) tensor of each parameter's shape, for :func:`~flockfl.aggregation.unflatten`."""
        return {k: torch.empty(s, device="meta") for k, s in zip(self.names, self.shapes)}

    def columns(self, names) -> torch.Tensor:
        """The flat coordinates of the listed parameters (in layout order)."""
        keep = set(names)
        parts = [torch.arange(self.offsets[i], self.offsets[i + 1]) for i, n in enumerate(self.names) if n in keep]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stacked parameters → [n, dim]."""
        return flatten(params, list(self.names))

    def unflatten(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """[n, dim] → stacked parameters (views of x)."""
        return unflatten(x, self.like, lead=0)

    def scatter(self, names, part: torch.Tensor, n: int) -> torch.Tensor:
        """A [n, dim] matrix holding ``part`` (the listed parameters' coordinates) in every row, 0 elsewhere."""
        full = torch.zeros(self.dim, dtype=part.dtype, device=part.device)
        full[self.columns(names).to(part.device)] = part
        return full[None].expand(n, -1)


def split_layout(model: nn.Module, decision_layers: Optional[int] = None) -> Layout:
    """ω = (φ, h) for ``model``: by default every conv and BatchNorm layer is φ and the Linear
    layers are h; a model without conv layers puts its last Linear layer in h. An integer n puts
    the last n Linear layers in h and everything before them in φ (φ may be empty)."""
    params = list(model.named_parameters())
    owner = {n: n.rsplit(".", 1)[0] if "." in n else "" for n, _ in params}
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    conv_bn = {name for name, m in model.named_modules()
               if isinstance(m, (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase))}
    if decision_layers is not None:
        if decision_layers > len(linears):
            raise ConfigError(f"algorithm.decision_layers: {decision_layers} exceeds the {len(linears)} Linear layers "
                              "of this model; lower it")
        head = set(linears[len(linears) - decision_layers:])
        decision = [n for n, _ in params if owner[n] in head]
    elif conv_bn:
        decision = [n for n, _ in params if owner[n] not in conv_bn]
    else:
        decision = [n for n, _ in params if owner[n] == (linears[-1] if linears else None)]
    offsets = np.cumsum([0] + [p.numel() for _, p in params]).tolist()
    return Layout(tuple(n for n, _ in params), tuple(tuple(p.shape) for _, p in params), tuple(offsets),
                  tuple(n for n, _ in params if n not in decision), tuple(decision))


def parameter_names(model_name: str, hidden: int = 200) -> list[str]:
    """The parameter names of an architecture, in order (they do not depend on the input
    shape, so a dummy 1×28×28 input serves every model)."""
    return [n for n, _ in build_model(model_name, (1, 28, 28), 2, hidden).named_parameters()]


def shared_parameters(spec: str, names: list[str]) -> list[str]:
    """The parameters ``algorithm.shared`` names (ValueError, one line, for a bad value)."""
    spec = spec.strip()
    if spec == "none":
        return []
    if spec == "all_but_last":
        head = names[-1].rsplit(".", 1)[0]  # the module that owns the last parameter
        shared = [n for n in names if n.rsplit(".", 1)[0] != head]
        if not shared:
            raise ValueError(f"algorithm.shared: all_but_last shares nothing: the model has one layer ({', '.join(names)}); "
                             "use none")
        return shared
    prefixes = [p.strip() for p in spec.split(",")]
    if any(not p for p in prefixes):
        raise ValueError(f"algorithm.shared: {spec!r} has an empty prefix; give none, all_but_last or prefixes like '1.,3.'")
    unknown = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if unknown:
        raise ValueError(f"algorithm.shared: {', '.join(map(repr, unknown))} matches no parameter (the model has "
                         f"{', '.join(names)}); give none, all_but_last or parameter-name prefixes")
    shared = [n for n in names if any(n.startswith(p) for p in prefixes)]
    if len(shared) == len(names):
        raise ValueError(f"algorithm.shared: {spec!r} shares every parameter, so the k models would be identical; "
                         "leave at least the last layer per cluster")
    return shared


def tie(models: dict[str, torch.Tensor], names: list[str], value: dict[str, torch.Tensor] | None = None
        ) -> dict[str, torch.Tensor]:
    """The models with each listed parameter stored once: a stride-0 ``[k, ...]`` view of
    ``value[name]`` (default: model 0's)."""
    if not names:
        return models
    out = dict(models)
    for n in names:
        v = models[n]
        one = (value[n] if value is not None else v[0]).detach().clone()
        out[n] = one.unsqueeze(0).expand(v.shape[0], *v.shape[1:])
    return out
