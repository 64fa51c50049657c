"""Evaluation kernels: loss and correctness sums of models on test rows, at the speed of the CPU.

What makes a full evaluation fast, and why each piece is exact:

- **One pass per model, not per client.** Clients that share a model (FedAvg: one; a clustered
  method: k) are measured by one pass of that model over the rows its clients need. The
  label-union test sets (every test sample of every label a client holds) overlap between
  clients; they are never copied per client. :class:`TestPool` keeps every test sample once per
  transform (a rotation: a "view"), sorted by class, and a pass returns per-class sums
  (:func:`class_sums`: loss sum and correct count of the rows of class c scored against every
  target label t): a client's sums are the entries of its classes under its own label map.
  Sums of the same per-row values, so exact up to float summation order.
- **Pooling as strided maxima.** PyTorch's CPU ``max_pool2d`` on NCHW tensors is about 12× slower
  than the four-way ``torch.maximum`` of the strided slices it computes (measured, torch 2.13);
  :class:`strided_pooling` swaps it in for every non-overlapping 2-D max-pool of a forward pass.
  A maximum is exact: the outputs are bit-identical.
- **The cheap order for known CNNs.** :mod:`flockfl.engine.convplan` runs ``lenet5``-like
  stacks and the BN CNNs as conv → pool → (BatchNorm's affine map) → ReLU, so the elementwise
  passes read a quarter of the convolution's output; bit for bit the model's own outputs.
- **Row chunks that fit the cache.** A pass feeds the rows in chunks sized so that the largest
  activation of a chunk stays near 6 MB (:func:`row_chunk`; a 2-conv CNN: 256 rows), which
  measured 2× faster per row than 4096-row batches.
- **Per-client models in vectorised chunks.** Dense stacks (MLP, MCLR) evaluate a chunk of
  clients' models with batched matmuls over their padded rows (:func:`dense_rows`); other
  models loop over the clients, each client's rows in cache-sized chunks (a vmapped convolution
  becomes a grouped convolution, which on a CPU is no faster than the loop).

The engine does not know clients' label sets or conventions: ``flockfl.evaluation`` combines
these sums into per-client metrics.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from flockfl.engine import convplan
from flockfl.engine.dense import dense_layers
from flockfl.engine.functional import per_sample_loss

F = nn.functional


# ---------------------------------------------------------------------- the test pool


@dataclass
class TestPool:
    """Every test sample once per view (a distinct input transform), sorted by class.

    View v is ``x[v]`` ([T, ...]); class c occupies rows ``class_offsets[c]:class_offsets[c+1]``
    of every view (its labels are those original classes). Client i is measured on view
    ``view[i]`` with label map ``perm[i]`` (original class → the client's label; None: the
    identity). Which classes a client holds is not stored here: it follows the client's current
    training data (a distribution shift changes it). ``position`` links the partition's own
    (proportional) test split to the pool: row r of that split is row ``position[r]`` of its
    client's view, so one pass of a model serves both test sets."""

    x: torch.Tensor  # [V, T, ...]
    class_offsets: np.ndarray  # [K + 1]
    view: np.ndarray  # [clients]
    perm: Optional[np.ndarray] = None  # [clients, K]
    position: Optional[np.ndarray] = None  # [rows of the partition's test split]

    @property
    def num_classes(self) -> int:
        return len(self.class_offsets) - 1

    @property
    def class_sizes(self) -> np.ndarray:
        return np.diff(self.class_offsets)

    def labels(self) -> torch.Tensor:
        """The original class of every row of a view."""
        return torch.repeat_interleave(torch.arange(self.num_classes, device=self.x.device),
                                       torch.from_numpy(self.class_sizes).to(self.x.device))

    def targets(self, clients: np.ndarray) -> np.ndarray:
        """[len(clients), K]: the label each client scores original class c against."""
        if self.perm is None:
            return np.broadcast_to(np.arange(self.num_classes), (len(clients), self.num_classes))
        return self.perm[clients]

    def runs(self, classes: np.ndarray) -> list[tuple[int, int]]:
        """Row ranges of the listed classes (ascending), adjacent classes merged into one run."""
        out: list[tuple[int, int]] = []
        for c in np.sort(np.asarray(classes, np.int64)):
            a, b = int(self.class_offsets[c]), int(self.class_offsets[c + 1])
            if a == b:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def to(self, device: torch.device) -> "TestPool":
        return TestPool(self.x.to(device), self.class_offsets, self.view, self.perm, self.position)


def sorted_by_class(y: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stable order of the rows by class, class offsets [K + 1], each row's place in that order)."""
    y = np.asarray(y, np.int64)
    order = np.argsort(y, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(y, minlength=num_classes))]).astype(np.int64)
    place = np.empty_like(order)
    place[order] = np.arange(len(order))
    return order, offsets, place


def identity_pool(x: torch.Tensor, y: torch.Tensor, num_classes: int, num_clients: int) -> TestPool:
    """The pool of a test split whose rows are the test set itself, untransformed (client data
    built without a partition): one view, identity label maps, every row linked."""
    order, offsets, place = sorted_by_class(y.cpu().numpy(), num_classes)
    return TestPool(x[torch.from_numpy(order).to(x.device)].unsqueeze(0), offsets, np.zeros(num_clients, np.int64),
                    position=place)


# ---------------------------------------------------------------------- a fast forward pass


class strided_pooling(TorchFunctionMode):
    """Inside this context, a non-overlapping 2-D max-pool (kernel = stride, no padding or
    dilation, floor mode) is the maximum of its strided slices: the same values as
    ``F.max_pool2d``, many times faster on a CPU. Anything else runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.max_pool2d:
            fast = _strided_max(*args, **kwargs)
            if fast is not None:
                return fast
        return func(*args, **kwargs)


def _strided_max(x: torch.Tensor, *args, **kwargs) -> Optional[torch.Tensor]:
    k = convplan.plain_pool(*args, **kwargs)
    if k is None or x.device.type != "cpu" or x.requires_grad:
        return None
    return convplan.max2d(x, k)


ACTIVATION_BYTES = 6 << 20  # a chunk's largest activation (measured: 2-conv CNN, 256 rows fastest)
_CHUNKS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


class _Largest(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.numel = 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.numel = max(self.numel, out.numel())
        return out


@torch.no_grad()
def row_chunk(model: nn.Module, x: torch.Tensor) -> int:
    """Rows per forward chunk: a power of two whose largest activation is near
    :data:`ACTIVATION_BYTES` (between 32 and 8192 rows), from one probe row per model."""
    if model not in _CHUNKS:
        probe = _Largest()
        with probe:
            model(x[:1])
        per_row = probe.numel * x.element_size()
        _CHUNKS[model] = int(2 ** np.clip(np.floor(np.log2(max(ACTIVATION_BYTES / per_row, 1))), 5, 13))
    return _CHUNKS[model]


@torch.no_grad()
def outputs(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One model's outputs on rows ``x`` (in evaluation mode), in cache-sized row chunks, with
    strided pooling."""
    was = model.training
    model.eval()  # BatchNorm with the model's statistics: a row's output never depends on its batch
    try:
        chunk = row_chunk(model, x) if len(x) else 1
        steps = convplan.plan(model) if x.device.type == "cpu" else None
        if steps is not None:  # the same bits in a cheaper order (its pools are already strided maxima)
            forward, mode = (lambda rows: convplan.run(steps, params, rows)), contextlib.nullcontext()
        else:
            forward, mode = (lambda rows: functional_call(model, params, (rows,))), strided_pooling()
        with mode:
            return torch.cat([forward(x[a:a + chunk]) for a in range(0, max(len(x), 1), chunk)])
    finally:
        model.train(was)


# ---------------------------------------------------------------------- sums


def class_sums(out: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([groups, K] loss sum, [groups, K] correct count) of the rows of each group scored against
    every target label t (cross-entropy −log softmax(out)[t]; correct: argmax = t), in float64.
    A group is a class (one model's clients) or a (client, class) pair (a model per client)."""
    k = out.shape[-1]
    loss = torch.zeros(groups, k, dtype=torch.float64, device=out.device)
    loss.index_add_(0, group, -torch.log_softmax(out, -1).double())
    hits = torch.zeros_like(loss)
    hits.index_add_(0, group, F.one_hot(out.argmax(-1), k).double())
    return loss, hits


def row_stats(out: torch.Tensor, y: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and correctness (as the trainers' loss: cross-entropy, or squared error)."""
    loss = per_sample_loss(out, y, task)
    hit = (out.argmax(-1) == y).to(loss.dtype) if task == "classification" else torch.zeros_like(loss)
    return loss, hit


def segment_sums(values: torch.Tensor, lengths: np.ndarray) -> np.ndarray:
    """Sums of consecutive segments of the given lengths, in float64."""
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=values.device),
                                  torch.from_numpy(np.asarray(lengths, np.int64)).to(values.device))
    out = torch.zeros(len(lengths), dtype=torch.float64, device=values.device)
    out.index_add_(0, seg, values.double())
    return out.cpu().numpy()


# ---------------------------------------------------------------------- many models, one each


def dense_rows(params: dict[str, torch.Tensor], layers: list[str], x: torch.Tensor, final_relu: bool = False
               ) -> torch.Tensor:
    """Outputs of C dense models, each on its own rows: x [C, R, ...] → [C, R, out] (``final_relu``:
    the layers are the first ones of a longer stack, so the last is followed by its ReLU too)."""
    a = x.reshape(x.shape[0], x.shape[1], -1)
    for i, name in enumerate(layers):
        a = torch.bmm(a, params[f"{name}.weight"].transpose(1, 2))
        b = params.get(f"{name}.bias")
        if b is not None:
            a += b.unsqueeze(1)
        if i < len(layers) - 1 or final_relu:
            a.clamp_min_(0)
    return a


def padded(x: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
    """Rows ``x[index[i]]`` of each of C clients, zero-padded to the longest: [C, R, ...] (one
    gather, one scatter)."""
    lengths = np.array([len(i) for i in index], np.int64)
    r = int(lengths.max(initial=0))
    out = x.new_zeros(len(index) * r, *x.shape[1:])
    if lengths.sum():
        starts = np.arange(len(index), dtype=np.int64) * r
        dest = np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        out[torch.from_numpy(dest).to(x.device)] = x[torch.cat(list(index))]
    return out.reshape(len(index), r, *x.shape[1:])


PAD_ROWS = 1 << 22  # padded rows × features of one batched dense pass (16 MB of float32 inputs)


def _one_model(t: torch.Tensor) -> bool:
    """True if stacked ``t`` holds one value for every client (one row, or a broadcast view)."""
    return t.dim() > 0 and (t.shape[0] == 1 or t.stride(0) == 0)


def _layer_of(key: str, layers: list[str]) -> int:
    return layers.index(key.rsplit(".", 1)[0])


class OwnOutputs:
    """Client i's model (row i of ``params``) on its rows ``x[index[i]]``, for any subset of the
    clients at a time (:meth:`__call__`), so that a caller can reduce the outputs of a bounded
    group before asking for the next.

    Dense stacks (MLP, MCLR) run as batched matmuls over groups of clients, and the leading
    layers whose parameters every client shares (FedRep's, FedPer's, FedBABU's body: a broadcast
    view, stride 0 on the client axis) run **once**, on the union of the rows the clients need:
    the per-client work is then the personal layers on the shared features. A one-layer personal
    part (a head) is one GEMM of the shared features with a group's heads side by side, each
    client reading its own rows. Other models loop over the clients, each client's rows in
    cache-sized chunks. The same sums of products as the per-client forward pass, up to float
    summation order."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, index: list[torch.Tensor]):
        self.model, self.params, self.x, self.index = model, params, x, index
        self.layers = dense_layers(model)
        if self.layers is None or not index:
            return
        layers = self.layers
        shared = 0
        while shared < len(layers) and all(_one_model(v) for k, v in params.items() if _layer_of(k, layers) == shared):
            shared += 1
        if shared == 0 or len(index) == 1:
            return
        # the shared layers once, on the union of the needed rows
        need = torch.zeros(len(x), dtype=torch.bool, device=x.device)
        for idx in index:
            need[idx] = True
        rows = torch.nonzero(need).squeeze(1)
        place = torch.cumsum(need, 0) - 1  # a needed row's place among the needed rows
        prefix = {k: v[:1] for k, v in params.items() if _layer_of(k, layers) < shared}
        width = int(np.prod(x.shape[1:])) or 1
        step = max(1, PAD_ROWS // width)
        last = shared == len(layers)
        feats = torch.cat([dense_rows(prefix, layers[:shared], x[rows[a:a + step]].unsqueeze(0), not last)[0]
                           for a in range(0, len(rows), step)])
        self.x, self.index = feats, [place[idx] for idx in index]
        self.layers = layers[shared:]
        self.params = {k: v for k, v in params.items() if _layer_of(k, layers) >= shared}

    @torch.no_grad()
    def __call__(self, which: Optional[np.ndarray] = None) -> list[torch.Tensor]:
        which = np.arange(len(self.index)) if which is None else np.asarray(which, np.int64)
        model, params, x, layers = self.model, self.params, self.x, self.layers
        index = [self.index[i] for i in which]
        if layers is None:
            return [outputs(model, {k: v[i] for k, v in params.items()}, x[self.index[i]]) for i in which]
        if not layers:  # every layer shared: the features are the outputs
            return [x[idx] for idx in index]
        lengths = np.array([len(i) for i in index], np.int64)
        device = x.device
        sel_all = torch.from_numpy(which).to(device)
        if len(layers) == 1 and len(index) and lengths.mean() * 4 >= len(x):
            return self._head(sel_all, index, layers[0])
        width = int(np.prod(x.shape[1:])) or 1
        if len(index) and lengths.max() * len(index) * width <= PAD_ROWS and lengths.max() <= 1.5 * max(lengths.mean(), 1):
            every = len(which) == len(self.index) and bool((which == np.arange(len(which))).all())
            mine = params if every else {k: v[sel_all] for k, v in params.items()}
            out = dense_rows(mine, layers, padded(x, index))  # even lengths: all at once, in order
            return [out[i, :n] for i, n in enumerate(lengths)]
        order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
        res: list[Optional[torch.Tensor]] = [None] * len(index)
        a = 0
        while a < len(order):
            b = a + 1
            while b < len(order) and (b + 1 - a) * lengths[order[b]] * width <= PAD_ROWS:
                b += 1
            group = order[a:b]
            sel = torch.from_numpy(which[group]).to(device)
            out = dense_rows({k: v[sel] for k, v in params.items()}, layers, padded(x, [index[i] for i in group]))
            for j, i in enumerate(group):
                res[i] = out[j, :lengths[i]]
            a = b
        return res  # type: ignore[return-value]

    def _head(self, sel: torch.Tensor, index: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """One Linear per client on the shared features: every feature row under a group of
        clients' heads side by side (one GEMM), each client keeping its own rows."""
        x, w, b = self.x, self.params[f"{name}.weight"], self.params.get(f"{name}.bias")
        feats = x.reshape(len(x), -1)
        k = w.shape[1]
        group = max(1, PAD_ROWS // max(len(x) * k, 1))
        res = []
        for a in range(0, len(index), group):
            s = sel[a:a + group]
            ws = w[s]  # [G, K, H]
            out = (feats @ ws.reshape(-1, ws.shape[-1]).T).reshape(len(x), len(s), k)
            if b is not None:
                out += b[s].unsqueeze(0)
            for j in range(len(s)):
                res.append(out[index[a + j], j])
        return res


def own_outputs(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, index: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """Client i's model (row i of ``params``) on its rows ``x[index[i]]``: one output tensor per
    client (:class:`OwnOutputs`, every client at once)."""
    return OwnOutputs(model, params, x, index)()
