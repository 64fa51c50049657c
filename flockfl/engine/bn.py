""""Precise BN" for cohorts (:func:`calibrate_bn`): every client's BN statistics recomputed
over its whole training set after local training, for groups of clients in one stacked pass
(the cohort's BN itself: ``flockfl.engine.functional.stacked_bn``).

flockfl's BN (``models.WeightedBatchNorm2d``) weighs each sample's contribution to the batch
statistics, so that the padded slots of a vectorised batch count for nothing and the two
trainers agree. Where no slot is padded (every step of the reference loop, a vectorised step
whose clients all fill the batch) the statistics are the plain ones, and the fused kernel
(``F.batch_norm``) computes them: the same numbers to float rounding, in one pass instead of a
dozen element-wise ones. ``WeightedBatchNorm2d.fused = False`` turns the fused kernel off
everywhere (the tests hold the two to each other).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from flockfl.engine.functional import conv_layout, memory_format, stacked_forward, stacked_plan


def bn_names(model: nn.Module) -> list[str]:
    """The model's BN layers (those with statistics among its parameters), in forward order."""
    return [n.rsplit(".", 1)[0] for n, p in model.named_parameters() if not p.requires_grad and n.endswith("running_mean")]


CALIBRATE_ROWS = 1024  # rows (clients × rows each) of one batched precise-BN pass (measured: docs/benchmarks.md)


@torch.no_grad()
def calibrate_bn(model: nn.Module, params: dict[str, torch.Tensor], data, clients: np.ndarray,
                 batched: bool = True) -> None:
    """"Precise BN": set each client's BN statistics (in place, row i for ``clients[i]``) to
    the exact mean and unbiased variance of each BN input over the client's whole training
    set, under its trained parameters. Shared by both trainers, so they agree.

    Batched (where the model has a stacked plan, ``flockfl.engine.functional.stacked_plan``):
    clients of equal size in groups of about :data:`CALIBRATE_ROWS` rows, one stacked forward a
    group up to the last BN, each BN's statistics by ``var_mean`` per client. Only equal sizes
    are grouped (no padding). A client's bits depend on how many clients share its grouped
    convolution (as the vectorised trainer's do on its shard): where they must not, the caller
    takes :func:`calibrate_bn_loop` (Sub-FedAvg's cache, which recalibrates only the clients
    whose subnetwork changed). Otherwise, and with ``batched=False`` (the reference the tests
    hold it to), one forward per client."""
    bns = bn_names(model)
    if not bns or len(clients) == 0:
        return
    plan = stacked_plan(model) if batched else None
    if plan is None:
        return calibrate_bn_loop(model, params, data, clients, bns)
    last = max(i for i, op in enumerate(plan) if op[0] == "bn")
    plan, fmt = plan[:last + 1], memory_format(conv_layout(model), data.x.device)
    sizes = np.asarray(data.sizes)[np.asarray(clients, np.int64)]
    order = [i for i in np.argsort(sizes, kind="stable") if sizes[i] > 0]
    a = 0
    while a < len(order):
        z = a + 1  # the group: clients a..z-1 of the size order, all of one size
        while z < len(order) and sizes[order[z]] == sizes[order[a]] and (z + 1 - a) * sizes[order[a]] <= CALIBRATE_ROWS:
            z += 1
        _calibrate_group(plan, fmt, params, data, np.asarray(clients), np.array(order[a:z]), sizes)
        a = z


def _calibrate_group(plan, fmt, params, data, clients: np.ndarray, rows: np.ndarray, sizes: np.ndarray) -> None:
    """Clients ``clients[rows]``, all of one size, in one stacked forward."""
    n = int(sizes[rows[0]])
    starts = np.asarray(data.offsets)[clients[rows]]
    if len(rows) == 1:  # one client: its rows as they are stored, no copy
        x = data.x[int(starts[0]):int(starts[0]) + n].unsqueeze(0)
    else:
        x = data.x[torch.from_numpy(starts[:, None] + np.arange(n)[None, :]).to(data.x.device)]
    record: list = []
    idx = torch.from_numpy(rows).to(next(iter(params.values())).device)
    stacked_forward(plan, {k: v[idx] for k, v in params.items()}, x, None, fmt, record)
    for bn, (mean, var, hw) in zip([op[1] for op in plan if op[0] == "bn"], record):
        count = n * hw
        params[f"{bn}.running_mean"][idx] = mean
        params[f"{bn}.running_var"][idx] = var * (count / max(count - 1, 1))  # as the loop's Python scalar


def calibrate_bn_loop(model: nn.Module, params: dict[str, torch.Tensor], data, clients: np.ndarray,
                      bns: list[str] | None = None) -> None:
    """:func:`calibrate_bn` one client at a time: the model's own forward over the client's
    whole training set, recording each BN's weighted statistics (the reference)."""
    bns = bn_names(model) if bns is None else bns
    if not bns:
        return
    was = model.training
    model.train()
    try:
        with torch.no_grad():
            for i, cid in enumerate(clients):
                x_c, _ = data.client(int(cid))
                if len(x_c) == 0:
                    continue
                record: list = []
                functional_call(model, {k: v[i] for k, v in params.items()}, (x_c,), {"record": record})
                for bn, (mean, var, count) in zip(bns, record):
                    params[f"{bn}.running_mean"][i] = mean
                    params[f"{bn}.running_var"][i] = var * (count / max(count - 1, 1))
    finally:
        model.train(was)
