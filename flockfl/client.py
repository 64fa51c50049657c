"""A client's local work as ``train.*`` describes it: the one place a :class:`LocalSpec` is
built from the train config, and plain local SGD outside a round's training (pre-training,
local ERMs, fine-tuning, newcomers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from flockfl.config import TrainConfig
from flockfl.engine.schedule import LocalSpec, LrSchedule, split_spec
from flockfl.engine.trainers import TrainResult

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


def train_pass(ctx: "RunContext", spec: LocalSpec, round: int) -> TrainResult:
    """Training outside a round's (pre-training, local ERMs, fine-tuning, newcomers, FedRep's head
    epochs, FedBABU's and Per-FedAvg's evaluation passes, pruning's fine-tuned evaluation), written
    once: the run's trainer (``ctx.trainer``), the clients in shards of ``train.shard_size`` (one
    vectorised batch each, as a round's), each shard tried again up to ``train.max_retries`` times
    before its error ends the pass (a round drops a client that keeps failing; a pass outside it
    has no result without that client)."""
    t, parts = ctx.cfg.train, []
    for shard in split_spec(spec, t.shard_size):
        for attempt in range(t.max_retries + 1):
            try:
                parts.append(ctx.trainer(ctx.model, shard, ctx.data.train, ctx.data.task, ctx.seed, round))
                break
            except Exception:
                if attempt == t.max_retries:
                    raise
    return TrainResult.concat(parts)


def train_from(ctx: "RunContext", start: dict[str, torch.Tensor], clients: np.ndarray, *,
               epochs: int, steps: Optional[int] = None, round: int = -1, stream: str) -> TrainResult:
    """Plain local SGD (``train.lr``, ``train.batch_size``) of every listed client from one
    model ``start``, outside a round's training (pre-training, local ERMs, newcomers): ``steps``
    steps, or ``epochs`` epochs when None; batch orders from the (seed, ``round``, client,
    ``stream``) streams; :func:`train_pass`."""
    t = ctx.cfg.train
    clients = np.asarray(clients, np.int64)
    init = {k: v.unsqueeze(0).expand(len(clients), *v.shape) for k, v in start.items()}
    return train_pass(ctx, pass_spec(t, clients, init, epochs, steps=steps, stream=stream, momentum=t.momentum), round)
