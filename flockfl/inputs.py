"""The files a run's configuration names, read once by its preparation
(:func:`flockfl.preparation.assemble`) into ``ctx.inputs``, so that no hook or stage opens a file:
an algorithm's (``Algorithm.input_files``: IFCA's ``init=given`` models, keyed as it names
them) and a stage's (``Stage.input_files``: the curriculum's expert, ``curriculum.expert``).

An algorithm's file holds what ``torch.save`` wrote. A stage's model comes from a path (a
``torch.save``'d parameter dict, or a flockfl checkpoint: its first model) or from a model URI
whose scheme the caller gives a reader for (``readers``: ``flockfl run`` passes MLflow's for
``models:/`` and ``runs:/``, tasks/__init__.py; the library itself never imports MLflow, and
the plain loop reads such a URI when its caller passes the same readers to ``prepare``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from flockfl.errors import ConfigError
from flockfl.state import MAGIC, decode_state

Reader = Callable[[str], dict[str, torch.Tensor]]
URI_SCHEMES = ("models:/", "runs:/")


def read_inputs(algorithm, stages: Iterable, model: torch.nn.Module, readers: dict[str, Reader]) -> dict:
    """Every file the algorithm and the stages name, read; an unreadable one is a one-line ConfigError."""
    out = {}
    for key, path in algorithm.input_files().items():
        try:
            out[key] = torch.load(Path(path), map_location="cpu", weights_only=True)
        except Exception as err:
            raise ConfigError(f"algorithm.{key}: cannot read {path} ({type(err).__name__}); "
                              "save k stacked models with torch.save") from None
    for stage in stages:
        out.update({key: read_model(key, source, model, readers) for key, source in stage.input_files().items()})
    return out


def read_model(key: str, source: str, model: torch.nn.Module, readers: dict[str, Reader]) -> dict[str, torch.Tensor]:
    """One model's parameters for the config key ``key`` from ``source`` (a model URI, a flockfl
    checkpoint or a ``.pt`` parameter dict), on the model's device; one line when it cannot be
    read or does not fit the run's model."""
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    scheme = next((s for s in readers if source.startswith(s)), None)
    if source.startswith(URI_SCHEMES) and scheme is None:
        raise ConfigError(f"{key}: {source!r} is an MLflow model URI, which flockfl run reads (the plain loop: pass "
                          "readers= to flockfl.preparation.prepare); run through flockfl, or give a .pt file")
    try:
        if scheme is not None:
            params = readers[scheme](source)
        else:
            path = Path(source)
            raw = path.read_bytes()
            if raw.startswith(MAGIC):  # a flockfl checkpoint: its (first) model
                params = {k: v[0] for k, v in decode_state(raw, str(path)).models.items()}
            else:
                params = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - one line for the user, whatever the reader raised
        raise ConfigError(f"{key}: cannot load {source!r} ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                          "give an MLflow model URI or a .pt file of this model's parameters") from None
    got = {n: tuple(v.shape) for n, v in params.items()}
    if got != want:
        raise ConfigError(f"{key}: {source!r} does not fit model.name (parameters {sorted(got)[:3]}… vs "
                          f"{sorted(want)[:3]}…); train the expert with the same model")
    device = next(model.parameters()).device
    return {k: v.to(device=device, dtype=torch.float32) for k, v in params.items()}
