"""Per-client test metrics and their summaries, in one place: every algorithm, stage and the
round driver measure clients with these functions."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from torch import nn

from flockfl.clientstate import chunks
from flockfl.engine.functional import losses_under_models, segment_mean

if TYPE_CHECKING:
    from flockfl.context import RunContext
    from flockfl.state import ServerState


def client_model_losses(model: nn.Module, models: dict[str, torch.Tensor], split, clients: np.ndarray, task: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean loss and accuracy of every listed client under every model, in one vectorised
    pass: returns ([k, C] loss, [k, C] accuracy, [C] sample counts)."""
    offsets = split.offsets
    idx = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in clients]) if len(clients) else np.zeros(0, np.int64)
    seg = np.repeat(np.arange(len(clients)), np.diff(offsets)[clients])
    idx_t = torch.from_numpy(idx).to(split.x.device)
    losses, hits = losses_under_models(model, models, split.x[idx_t], split.y[idx_t], task)
    seg_t = torch.from_numpy(seg).to(losses.device)
    mean_loss, counts = segment_mean(losses, seg_t, len(clients))
    mean_acc, _ = segment_mean(hits, seg_t, len(clients))
    return mean_loss.cpu(), mean_acc.cpu(), counts.cpu()


EVAL_CHUNK = 4096  # clients per evaluation pass of one model


def summarise_clients(c_loss: np.ndarray, c_acc: np.ndarray, n: np.ndarray, task: str, suffix: str = "") -> dict[str, float]:
    """Sample-weighted mean loss (and accuracy, its minimum and 10th percentile) over clients."""
    has = n > 0
    w = n / max(n.sum(), 1)
    out = {f"loss{suffix}": float((c_loss * w).sum())}
    if task == "classification":
        out[f"accuracy{suffix}"] = float((c_acc * w).sum())
        out[f"accuracy{suffix}_min"] = float(c_acc[has].min()) if has.any() else float("nan")
        out[f"accuracy{suffix}_p10"] = float(np.percentile(c_acc[has], 10)) if has.any() else float("nan")
    return out


def evaluate_models(models: dict[str, torch.Tensor], assign: np.ndarray, ctx: RunContext,
                    clients: Optional[np.ndarray] = None) -> dict[str, Any]:
    """Per-client test metrics with each client's own model, and their summaries.

    ``assign`` gives the model of every client (all ``ctx.num_clients``); the metrics cover
    ``clients`` (default: all). ``_assignment`` in the result covers every client."""
    clients = np.arange(ctx.num_clients) if clients is None else np.asarray(clients, np.int64)
    mine = assign[clients]
    c_loss, c_acc, n = own_cluster_metrics(ctx.model, models, mine, ctx.data.test, clients, ctx.data.task)
    out: dict[str, Any] = summarise_clients(c_loss, c_acc, n, ctx.data.task)
    out.update(cluster_breakdown(ctx, clients, mine, c_loss, c_acc, n, next(iter(models.values())).shape[0]))
    if "theta" in ctx.truth:
        out["min_dist"] = min_dist(models, ctx.truth["theta"])
    out["_client_accuracy"] = c_acc if ctx.data.task == "classification" else None
    out["_client_loss"] = c_loss
    out["_assignment"] = assign
    return out


def cluster_breakdown(ctx: RunContext, clients: np.ndarray, mine: np.ndarray, c_loss: np.ndarray, c_acc: np.ndarray,
                      n: np.ndarray, k: int) -> dict[str, Any]:
    """Per-cluster client counts and accuracy (loss for regression), the number of clusters
    in use, and ARI/NMI of ``mine`` against the clients' current true groups (when known)."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    out: dict[str, Any] = {}
    key = "accuracy" if ctx.data.task == "classification" else "loss"
    vals = c_acc if key == "accuracy" else c_loss
    for j in range(k):
        m = (mine == j) & (n > 0)
        out[f"cluster/{j}/clients"] = int((mine == j).sum())
        if m.any():
            out[f"cluster/{j}/{key}"] = float((vals[m] * n[m]).sum() / n[m].sum())
    out["num_clusters"] = int(len(np.unique(mine)))
    group = ctx.data.group[clients]
    if (group >= 0).all() and len(np.unique(group)) > 1:
        out["ari"] = float(adjusted_rand_score(group, mine))
        out["nmi"] = float(normalized_mutual_info_score(group, mine))
    return out


def own_cluster_metrics(model: nn.Module, models: dict[str, torch.Tensor], which: np.ndarray, split, clients: np.ndarray,
                        task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean loss and accuracy of every listed client under model ``which[i]`` only: one pass per
    model over its own clients (with k ≥ clients, e.g. local training, never k × clients)."""
    c_loss, c_acc, n = np.zeros(len(clients)), np.zeros(len(clients)), np.zeros(len(clients), np.int64)
    which = np.maximum(which, 0)
    for j in np.unique(which):
        one = {k: v[int(j) : int(j) + 1] for k, v in models.items()}
        for pos in chunks(np.flatnonzero(which == j), EVAL_CHUNK):  # a bounded slice of the test data at a time
            loss, acc, cnt = client_model_losses(model, one, split, clients[pos], task)
            c_loss[pos], c_acc[pos], n[pos] = loss[0].numpy(), acc[0].numpy(), cnt.numpy()
    return c_loss, c_acc, n


@torch.no_grad()
def own_model_metrics(model: nn.Module, params: dict[str, torch.Tensor], split, clients: np.ndarray, task: str
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean loss and accuracy of every listed client under its own model (``params`` row i
    belongs to ``clients[i]``): returns ([C] loss, [C] accuracy, [C] sample counts)."""
    from torch.func import functional_call

    from flockfl.engine.functional import correct, per_sample_loss

    losses, accs, counts = [], [], []
    for i, c in enumerate(clients):
        x, y = split.client(int(c))
        counts.append(len(y))
        if len(y) == 0:
            losses.append(0.0)
            accs.append(0.0)
            continue
        out = functional_call(model, {k: v[i] for k, v in params.items()}, (x,))
        losses.append(float(per_sample_loss(out, y, task).mean()))
        accs.append(float(correct(out, y, task).mean()))
    return np.array(losses), np.array(accs), np.array(counts)


def min_dist(models: dict[str, torch.Tensor], theta: np.ndarray) -> float:
    """IFCA's metric: (1/k) Σ_j min_j' ‖θ_j − θ*_j'‖ for linear models."""
    w = next(iter(models.values())).reshape(next(iter(models.values())).shape[0], -1).double().cpu()
    t = torch.as_tensor(theta, dtype=torch.float64)
    return float(torch.cdist(w, t).min(1).values.mean())


def time_to_target(history: list[dict], target: Optional[float]) -> dict[str, Any]:
    """The first evaluated round whose mean accuracy reaches ``target``, and its sim_time."""
    if target is None:
        return {}
    hit = next((h for h in history if h.get("accuracy", -1.0) >= target), None)
    return {"target_accuracy": target, "rounds_to_target": hit["round"] if hit else None,
            "sim_time_to_target": hit["sim_time"] if hit else None}


def summarise(state: ServerState, target: Optional[float] = None) -> dict[str, Any]:
    """Final metrics, the median round time leaving out the first round, and time to target."""
    last = state.history[-1] if state.history else {}
    keep = ("accuracy", "accuracy_min", "accuracy_p10", "loss", "accuracy_finetuned", "accuracy_finetuned_min",
            "accuracy_finetuned_p10", "loss_finetuned", "unseen_accuracy", "unseen_accuracy_p10",
            "unseen_accuracy_untuned", "ari", "nmi", "num_clusters", "min_dist", "sim_time", "accuracy_pruned",
            "accuracy_pruned_min", "accuracy_pruned_finetuned", "sparsity", "channel_sparsity", "comm_bytes",
            "comm_bytes_thesis")
    metrics = {k: last[k] for k in keep if k in last and not (isinstance(last[k], float) and math.isnan(last[k]))}
    times = [h["round_time_s"] for h in state.history[1:]] or [h["round_time_s"] for h in state.history]
    return {"metrics": metrics, "round_s_median": float(np.median(times)) if times else float("nan"),
            **time_to_target(state.history, target)}
