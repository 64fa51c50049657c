"""Per-client test metrics, measured in one place: every algorithm, stage and the round driver
measure clients with these functions, on both test sets of :mod:`flockfl.eval_protocol` (the
protocols, conventions and metric names); the reports over rounds are in
:mod:`flockfl.eval_summary`. Also here: a round's evaluation result with its cluster breakdown,
and the training side's measurements on one split as it is.

**Exact and fast.** A model is evaluated once on all the rows its clients need (clients that
share a model in one pass, a per-client model on its own rows), and each client's sums are
combined from per-class sums over the shared test pool (:mod:`flockfl.engine.evaluate`); the
proportional rows ride along in the same pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from flockfl.clientstate import chunks
from flockfl.clustering.similarity import ari, nmi
from flockfl.engine.evaluate import OwnOutputs, TestPool, class_sums, identity_pool, outputs, row_stats, segment_sums
from flockfl.engine.functional import losses_under_models, segment_mean
from flockfl.errors import ConfigError
from flockfl.eval_protocol import ClientMetrics, Triple, family, label_union_applies, protocol
from flockfl.eval_reuse import measure_shared_reused

if TYPE_CHECKING:
    from flockfl.context import RunContext


# ---------------------------------------------------------------------- measuring, both test sets


def label_pool(ctx: RunContext) -> TestPool:
    """The run's test pool: the partition's (``ClientData.pool``), or for client data built
    without one, its test split as the pool (built once, kept on the data)."""
    base = ctx.base_data
    if base.pool is None:
        base.pool = identity_pool(base.test.x, base.test.y, base.num_classes, base.num_clients)
    return base.pool


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the ranges [starts[i], starts[i] + lengths[i]), back to back."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    shift = np.repeat(np.asarray(starts, np.int64) - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


def held_classes(split, clients: np.ndarray, num_classes: int) -> np.ndarray:
    """[clients, K] bool: which labels each listed client holds in ``split`` (its training data)."""
    off = split.offsets
    lengths = off[clients + 1] - off[clients]
    idx = ranges(off[clients], lengths)
    y = split.y[torch.from_numpy(idx).to(split.y.device)].cpu().numpy().astype(np.int64)
    out = np.zeros((len(clients), num_classes), bool)
    out[np.repeat(np.arange(len(clients)), lengths), y] = True
    return out


class _Measure:
    """Loss and correct sums of the listed clients, filled one model at a time, on both test sets.

    A model's pass covers, in each view of the pool, the classes its clients hold (and, when the
    partition's split is linked to the pool, their proportional rows: one forward serves both)."""

    def __init__(self, ctx: RunContext, clients: np.ndarray, own: bool = False):
        self.model, self.test, self.task = ctx.model, ctx.data.test, ctx.data.task
        self.clients = np.asarray(clients, np.int64)
        n = len(self.clients)
        self.loss = {"proportional": np.zeros(n)}
        self.hits = {"proportional": np.zeros(n)}
        self.count = {"proportional": self.test.sizes[self.clients].astype(np.int64)}
        self.pool: Optional[TestPool] = None
        self.linked = False
        if self.task == "classification" and label_union_applies(ctx.cfg, own):
            pool = self.pool = label_pool(ctx)
            k = pool.num_classes
            self.targets = np.asarray(pool.targets(self.clients))  # [n, K]: original class → the client's label
            own = held_classes(ctx.data.train, self.clients, k)
            self.mask = np.take_along_axis(own, self.targets, 1)  # over original classes
            self.labels = np.repeat(np.arange(k), pool.class_sizes)  # each pool row's original class
            self.loss["label_union"], self.hits["label_union"] = np.zeros(n), np.zeros(n)
            self.count["label_union"] = (self.mask * pool.class_sizes).sum(1).astype(np.int64)
            # a distribution shift regroups the test rows: then the proportional rows take their own pass
            self.linked = pool.position is not None and ctx.data.test is ctx.base_data.test

    # ------------------------------------------------------------------ rows
    def prop_rows(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the partition's test split of ``clients[pos]``, back to back, and their counts."""
        c = self.clients[pos]
        lengths = self.test.offsets[c + 1] - self.test.offsets[c]
        return ranges(self.test.offsets[c], lengths), lengths

    def pool_rows(self, pos: np.ndarray) -> np.ndarray:
        """The rows of one view that clients ``pos`` (all in it) need: their classes, and their
        proportional rows when linked."""
        pool = self.pool
        need = np.zeros(pool.x.shape[1], bool)
        for a, b in pool.runs(np.flatnonzero(self.mask[pos].any(0))):
            need[a:b] = True
        if self.linked:
            need[pool.position[self.prop_rows(pos)[0]]] = True
        return np.flatnonzero(need)

    # ------------------------------------------------------------------ absorbing outputs
    def absorb_rows(self, out: torch.Tensor, y: torch.Tensor, pos: np.ndarray, lengths: np.ndarray) -> None:
        """Outputs on the proportional rows of ``clients[pos]`` (back to back, ``lengths`` each)."""
        if len(y) == 0:
            return
        loss, hit = row_stats(out, y, self.task)
        self.loss["proportional"][pos] = segment_sums(loss, lengths)
        self.hits["proportional"][pos] = segment_sums(hit, lengths)

    def absorb_pool(self, out: torch.Tensor, rows: list[np.ndarray], blocks: list[np.ndarray]) -> None:
        """Outputs on ``rows[b]`` (of one view each, back to back), on which every client of
        ``blocks[b]`` was measured (one block of clients sharing a model, or one block per client
        with its own model): label-union sums from per-(block, class) sums, and (linked) the
        proportional sums from the same outputs."""
        k = self.pool.num_classes
        lengths = np.array([len(r) for r in rows], np.int64)
        if lengths.sum() == 0:
            return
        flat = np.concatenate(rows)
        group = np.repeat(np.arange(len(rows)), lengths) * k + self.labels[flat]
        loss, hits = (t.cpu().numpy().reshape(len(rows), k, k)
                      for t in class_sums(out, torch.from_numpy(group).to(out.device), len(rows) * k))
        pos = np.concatenate(blocks)
        block = np.repeat(np.arange(len(blocks)), [len(b) for b in blocks])[:, None]
        tg, m, cls = self.targets[pos], self.mask[pos], np.arange(k)[None, :]
        self.loss["label_union"][pos] = (loss[block, cls, tg] * m).sum(1)
        self.hits["label_union"][pos] = (hits[block, cls, tg] * m).sum(1)
        if self.linked:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            at, ids, counts = [], [], []
            for b, part in enumerate(blocks):
                idx, n = self.prop_rows(part)
                at.append(starts[b] + np.searchsorted(rows[b], self.pool.position[idx]))
                ids.append(idx)
                counts.append(n)
            at_t = torch.from_numpy(np.concatenate(at)).to(out.device)
            y = self.test.y[torch.from_numpy(np.concatenate(ids)).to(self.test.y.device)]
            self.absorb_rows(out[at_t], y, pos, np.concatenate(counts))

    # ------------------------------------------------------------------ models
    def shared(self, params: dict[str, torch.Tensor], pos: np.ndarray) -> None:
        """Clients ``clients[pos]`` all under one model (unstacked ``params``)."""
        if not self.linked:
            for part in chunks(pos, EVAL_CHUNK):
                idx, lengths = self.prop_rows(part)
                t = torch.from_numpy(idx).to(self.test.x.device)
                self.absorb_rows(outputs(self.model, params, self.test.x[t]), self.test.y[t], part, lengths)
        if self.pool is None:
            return
        views = self.pool.view[self.clients[pos]]
        for v in np.unique(views):
            group = pos[views == v]
            rows = self.pool_rows(group)
            x = self.pool.x[int(v)]
            x = x if len(rows) == len(x) else x[torch.from_numpy(rows).to(x.device)]
            self.absorb_pool(outputs(self.model, params, x), [rows], [group])

    def own(self, params: dict[str, torch.Tensor], pos: np.ndarray) -> None:
        """Client ``clients[pos[r]]`` under its own model, row r of the stacked ``params``.

        The outputs are reduced to per-client sums a group of at most :data:`ABSORB_ROWS` rows
        at a time, so memory holds one group's outputs (not the chunk's: 1,000 clients on a
        10,000-row label union are 10⁷ rows)."""
        single = [pos[r:r + 1] for r in range(len(pos))]
        if not self.linked:
            index = [torch.from_numpy(self.prop_rows(p)[0]).to(self.test.x.device) for p in single]
            run = OwnOutputs(self.model, params, self.test.x, index)
            for g in row_groups([len(i) for i in index]):
                outs = run(g)
                if outs:
                    self.absorb_rows(torch.cat(outs), self.test.y[torch.cat([index[r] for r in g])], pos[g],
                                     np.array([len(index[r]) for r in g]))
        if self.pool is None:
            return
        pool = self.pool
        flat = pool.x.reshape(-1, *pool.x.shape[2:])
        rows = [self.pool_rows(p) for p in single]
        offset = pool.view[self.clients[pos]] * pool.x.shape[1]
        index = [torch.from_numpy(rows[r] + offset[r]).to(flat.device) for r in range(len(pos))]
        run = OwnOutputs(self.model, params, flat, index)
        for g in row_groups([len(r) for r in rows]):
            outs = run(g)
            if outs:
                self.absorb_pool(torch.cat(outs), [rows[r] for r in g], [single[r] for r in g])

    def result(self) -> ClientMetrics:
        sets = {}
        for ts in self.loss:
            n = self.count[ts]
            d = np.maximum(n, 1)
            sets[ts] = (self.loss[ts] / d, self.hits[ts] / d, n)
        return ClientMetrics(sets)


EVAL_CHUNK = 4096  # clients per pass over the proportional rows of one model
ABSORB_ROWS = 1 << 20  # output rows of per-client models reduced at a time (a group: about 40 MB of logits)


def row_groups(lengths: list[int], limit: int = ABSORB_ROWS) -> list[np.ndarray]:
    """Consecutive groups of positions whose lengths sum to at most ``limit`` (a longer one alone)."""
    out, a, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > a and total + n > limit:
            out.append(np.arange(a, i))
            a, total = i, 0
        total += n
    if a < len(lengths):
        out.append(np.arange(a, len(lengths)))
    return out


def measure_shared(ctx: RunContext, models: dict[str, torch.Tensor], which: np.ndarray, clients: np.ndarray
                   ) -> ClientMetrics:
    """Every listed client under model ``which[i]`` of the stacked ``models`` (−1 counts as
    model 0, as before): one pass per model over the rows its clients need."""
    m = _Measure(ctx, clients)
    which = np.maximum(np.asarray(which, np.int64), 0)
    for j in np.unique(which):
        m.shared({k: v[int(j)] for k, v in models.items()}, np.flatnonzero(which == j))
    return m.result()


def measure_own(ctx: RunContext, params: dict[str, torch.Tensor], clients: np.ndarray) -> ClientMetrics:
    """Every listed client under its own model (row i of ``params`` is ``clients[i]``'s), in
    chunks of ``train.eval_chunk`` clients."""
    clients = np.asarray(clients, np.int64)
    m = _Measure(ctx, clients, own=True)
    for part in chunks(np.arange(len(clients)), ctx.cfg.train.eval_chunk):
        whole = len(part) == len(clients)
        sel = torch.from_numpy(part).to(next(iter(params.values())).device)
        m.own(params if whole else {k: v[:1].expand(len(part), *v.shape[1:]) if v.stride(0) == 0 else v[sel]
                                    for k, v in params.items()}, part)  # a broadcast view stays one
    return m.result()


# ---------------------------------------------------------------------- a round's evaluation result


def client_results(ctx: RunContext, cm: ClientMetrics, assign: np.ndarray, breakdown: Callable[[Triple], dict]
                   ) -> dict[str, Any]:
    """An evaluation's result: the family's summaries, the per-cluster ``breakdown`` of the
    configured test set's triple, each client's loss and accuracy, and every client's model."""
    proto, task = protocol(ctx), ctx.data.task
    if proto.test_set not in cm.sets:  # a family measured by a pre-protocol function: one test set only
        raise ConfigError(f"eval.test_set: algorithm {ctx.cfg.algorithm.name!r} measures its clients on the proportional "
                          f"test set only, not {proto.test_set!r}; use eval.test_set=proportional")
    out: dict[str, Any] = family(cm, proto, task)
    mine = cm[proto.test_set]
    out.update(breakdown(mine))
    out["_client_accuracy"] = mine[1] if task == "classification" else None
    out["_client_loss"] = mine[0]
    out["_assignment"] = assign
    return out


def evaluate_models(models: dict[str, torch.Tensor], assign: np.ndarray, ctx: RunContext,
                    clients: Optional[np.ndarray] = None) -> dict[str, Any]:
    """Per-client test metrics with each client's own model, and their summaries.

    ``assign`` gives the model of every client (all ``ctx.num_clients``); the metrics cover
    ``clients`` (default: all). ``_assignment`` in the result covers every client."""
    clients = np.arange(ctx.num_clients) if clients is None else np.asarray(clients, np.int64)
    mine = assign[clients]
    k = next(iter(models.values())).shape[0]
    out = client_results(ctx, measure_shared_reused(ctx, "assigned", models, mine, clients, measure_shared), assign,
                         lambda t: cluster_breakdown(ctx, clients, mine, *t, k))
    if "theta" in ctx.truth:
        out["min_dist"] = min_dist(models, ctx.truth["theta"])
    return out


def cluster_breakdown(ctx: RunContext, clients: np.ndarray, mine: np.ndarray, c_loss: np.ndarray, c_acc: np.ndarray,
                      n: np.ndarray, k: int) -> dict[str, Any]:
    """Per-cluster client counts and accuracy (loss for regression; the mean ``eval.average``
    says), the number of clusters in use, and ARI/NMI of ``mine`` against the clients' current
    true groups (when known)."""
    out: dict[str, Any] = {}
    key = "accuracy" if ctx.data.task == "classification" else "loss"
    vals = c_acc if key == "accuracy" else c_loss
    weight = n if ctx.cfg.eval.average == "samples" else (n > 0).astype(np.float64)
    for j in range(k):
        m = (mine == j) & (n > 0)
        out[f"cluster/{j}/clients"] = int((mine == j).sum())
        if m.any():
            out[f"cluster/{j}/{key}"] = float((vals[m] * weight[m]).sum() / weight[m].sum())
    out["num_clusters"] = int(len(np.unique(mine)))
    group = ctx.data.group[clients]
    if (group >= 0).all() and len(np.unique(group)) > 1:
        out["ari"], out["nmi"] = ari(group, mine), nmi(group, mine)
    return out


# ---------------------------------------------------------------------- one split, no protocol
# (the training side's measurements: IFCA's cluster losses, the curriculum's scores, pruning's
# accuracy gate; they read one split as it is)


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


def own_cluster_metrics(model: nn.Module, models: dict[str, torch.Tensor], which: np.ndarray, split, clients: np.ndarray,
                        task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean loss and accuracy of every listed client under model ``which[i]`` only: one pass per
    model over its own clients (with k ≥ clients, e.g. local training, never k × clients)."""
    c_loss, c_acc, n = np.zeros(len(clients)), np.zeros(len(clients)), np.zeros(len(clients), np.int64)
    which = np.maximum(which, 0)
    for j in np.unique(which):
        one = {k: v[int(j) : int(j) + 1] for k, v in models.items()}
        for pos in chunks(np.flatnonzero(which == j), EVAL_CHUNK):  # a bounded slice of the data at a time
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

