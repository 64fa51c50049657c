"""Each client's local optimiser state across its rounds (``train.optimizer_state=persist``).

Under ``persist`` the state holds ``state.algo['optimizer_state']``, a
:class:`~flockfl.clientstate.ClientTable` of every client's local momentum buffer: one row of the
trained parameters' shapes and dtypes, zeros (a fresh optimiser) until the client's first round.
A round gathers its cohort's rows into ``LocalSpec.momentum_init`` (:func:`gather_into`), the
trainers start from them and return their final buffers in ``TrainResult.meta['momentum_buffer']``,
and :func:`keep` writes those back after aggregation; a dropped client keeps the buffer it had.
The checkpoints carry the table like any other (its rows under ``client_state/optimizer_state``),
so a resumed client goes on with its buffer. ``reset`` (the default) keeps no optimiser state:
every function here then returns what it was given.
"""

from __future__ import annotations

import dataclasses

import torch

from flockfl.clientstate import ClientTable
from flockfl.config import ExperimentConfig
from flockfl.engine import LocalSpec, TrainResult
from flockfl.engine.trainers import stat_names
from flockfl.errors import ConfigError
from flockfl.state import ServerState

OPTIMIZER_STATE = "optimizer_state"  # the table's key in state.algo


def persists(cfg: ExperimentConfig) -> bool:
    return cfg.train.optimizer_state == "persist"


def with_table(cfg: ExperimentConfig, model: torch.nn.Module, num_clients: int, state: ServerState) -> ServerState:
    """The state with the table of every client's buffer, added once (a resumed state has it)."""
    if not persists(cfg) or OPTIMIZER_STATE in state.algo:
        return state
    frozen = set(stat_names(model))  # BN statistics: never stepped, no buffer
    zeros = {n: torch.zeros_like(state.models[n][0]) for n, _ in model.named_parameters() if n not in frozen}
    return state.replace(algo={**state.algo, OPTIMIZER_STATE: ClientTable(num_clients, zeros)})


def gather_into(cfg: ExperimentConfig, state: ServerState, spec: LocalSpec, device) -> LocalSpec:
    """``spec`` with each of its clients' buffers as its ``momentum_init`` (where the last round left it)."""
    if not persists(cfg):
        return spec
    return dataclasses.replace(spec, momentum_init=state.algo[OPTIMIZER_STATE].gather(spec.clients, device))


def keep(cfg: ExperimentConfig, method: str, received: ServerState, state: ServerState,
         result: TrainResult) -> ServerState:
    """``state`` (after aggregation) with the trained clients' final buffers written into the table of
    ``received`` (the state they trained from). A local update that returns no buffer (a closed-form
    solver, a method's own loop) is refused in one line rather than silently reset."""
    if not persists(cfg):
        return state
    if "momentum_buffer" not in result.meta:
        raise ConfigError(f"train.optimizer_state=persist: {method}'s local update returned no optimiser "
                          "state (a closed-form solver or its own loop, not the trainers' SGD); set "
                          "train.optimizer_state=reset")
    table = received.algo[OPTIMIZER_STATE].scatter(result.clients, result.meta["momentum_buffer"])
    return state.replace(algo={**state.algo, OPTIMIZER_STATE: table})
