"""A client's local work as ``train.*`` describes it: the one place a :class:`LocalSpec` is
built from the train config, and plain local SGD outside a round's training (pre-training,
local ERMs, fine-tuning, newcomers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from flockfl.config import ExperimentConfig, TrainConfig
from flockfl.engine import TRAINERS
from flockfl.engine.schedule import LocalSpec, LrSchedule, restrict
from flockfl.engine.trainers import TrainResult
from flockfl.state import ServerState

if TYPE_CHECKING:
    from flockfl.context import RunContext


def optimiser(t: TrainConfig) -> dict:
    """The local optimiser's terms every spec built from ``train.*`` carries: weight decay and
    the learning-rate schedule (momentum is set by the round driver or the caller)."""
    return {"weight_decay": t.weight_decay,
            "lr_schedule": LrSchedule(t.lr_schedule, t.lr_alpha, t.lr_b, t.lr_gamma, t.lr_step_rounds)}


def round_spec(t: TrainConfig, clients: np.ndarray, init: dict[str, torch.Tensor], **extra) -> LocalSpec:
    """A round's local training: ``train.lr`` (on its schedule, with ``train.weight_decay``), E
    epochs (or τ steps), batch size B or full batch; ``extra`` adds the algorithm's terms (prox,
    corrections, meta, ...)."""
    return LocalSpec(clients, init, t.lr, t.local_epochs, t.local_steps, t.batch_size, t.full_batch,
                     **{**optimiser(t), **extra})


def finetune_epochs(t: TrainConfig) -> int:
    """Local epochs of the "after local training" evaluation and of newcomers' fine-tuning
    (``train.finetune_epochs``, by default ``train.local_epochs``)."""
    return t.local_epochs if t.finetune_epochs is None else t.finetune_epochs


def pass_spec(t: TrainConfig, clients: np.ndarray, init: dict[str, torch.Tensor], epochs: int, *,
              steps: Optional[int] = None, stream: str, **extra) -> LocalSpec:
    """A pass of plain local SGD outside a round's training (``epochs`` epochs, or ``steps``
    steps; ``train.lr`` on its schedule, with ``train.weight_decay``), its batch orders from the
    (seed, round, client, ``stream``) streams."""
    return LocalSpec(clients, init, t.lr, epochs, steps, t.batch_size, t.full_batch, stream=stream,
                     **{**optimiser(t), **extra})


def run_engine(cfg: ExperimentConfig, state: ServerState) -> str:
    """The trainer this run uses: the one it chose (``state.meta['engine']``), or the configured
    one before any round has chosen (auto → vectorized)."""
    return state.meta.get("engine") or ("vectorized" if cfg.train.engine == "auto" else cfg.train.engine)


def train_from(ctx: RunContext, state: ServerState, start: dict[str, torch.Tensor], clients: np.ndarray, *,
               epochs: int, steps: Optional[int] = None, round: int = -1, stream: str) -> TrainResult:
    """Plain local SGD (``train.lr``, ``train.batch_size``) of every listed client from one
    model ``start``, outside a round's training (pre-training, local ERMs, newcomers): ``steps``
    steps, or ``epochs`` epochs when None; sharded like a round (``train.shard_size``); batch
    orders from the (seed, ``round``, client, ``stream``) streams."""
    t = ctx.cfg.train
    clients = np.asarray(clients, np.int64)
    init = {k: v.unsqueeze(0).expand(len(clients), *v.shape) for k, v in start.items()}
    spec = pass_spec(t, clients, init, epochs, steps=steps, stream=stream, momentum=t.momentum)
    trainer = TRAINERS[run_engine(ctx.cfg, state)]
    return TrainResult.concat([trainer(ctx.model, restrict(spec, slice(a, min(len(clients), a + t.shard_size))),
                                       ctx.data.train, ctx.data.task, ctx.seed, round)
                               for a in range(0, len(clients), t.shard_size)])
