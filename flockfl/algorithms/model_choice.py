"""How a client picks one of k models: the lowest training loss (IFCA's rule, ties to the
lowest index) or the highest mean confidence on its unlabelled inputs (DIFCA's "confidence
based inference")."""

from __future__ import annotations

import numpy as np
import torch

from flockfl.context import RunContext
from flockfl.engine.functional import segment_mean, stacked_outputs
from flockfl.evaluation import client_model_losses
from flockfl.state import ServerState


def cluster_losses(state: ServerState, ctx: RunContext, clients: np.ndarray) -> torch.Tensor:
    """[k, C] mean training loss of every listed client under every cluster model (one pass)."""
    loss, _, _ = client_model_losses(ctx.model, state.models, ctx.data.train, clients, ctx.data.task)
    return loss


def assign_by_min_loss(losses: torch.Tensor) -> np.ndarray:
    """ĵ = argmin_j F_i(θ_j), ties broken by the lowest index (as np.argmin)."""
    return np.argmin(losses.numpy(), axis=0).astype(np.int64)


@torch.no_grad()
def client_confidences(model, models: dict[str, torch.Tensor], split, clients: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, C] mean max-softmax of every listed client's inputs under every model (labels
    unused), and the [C] sample counts."""
    offsets = split.offsets
    idx = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in clients] or [np.zeros(0, np.int64)])
    seg = np.repeat(np.arange(len(clients)), np.diff(offsets)[clients])
    x = split.x[torch.from_numpy(idx).to(split.x.device)]
    k = next(iter(models.values())).shape[0]
    if len(idx) == 0:
        return torch.zeros(k, len(clients)), torch.zeros(len(clients))
    conf = stacked_outputs(model, models, x).softmax(-1).amax(-1)
    mean, counts = segment_mean(conf, torch.from_numpy(seg).to(conf.device), len(clients))
    return mean.cpu(), counts.cpu()


def confidence_scores(model, models: dict[str, torch.Tensor], data, clients: np.ndarray) -> torch.Tensor:
    """[k, C] confidences on the clients' test inputs (their training inputs when they have none)."""
    conf, counts = client_confidences(model, models, data.test, clients)
    empty = (counts == 0).numpy()
    if empty.any():
        conf[:, torch.from_numpy(empty)] = client_confidences(model, models, data.train, clients[empty])[0]
    return conf


def assign_by_max_confidence(conf: torch.Tensor) -> np.ndarray:
    """ĵ = argmax_j confidence, ties → lowest index."""
    return np.argmax(conf.numpy(), axis=0).astype(np.int64)
