"""Client-level distribution shift (FlexCFL, Duan et al., IEEE TPDS 2022, §5.3; spec
``flexcfl.md`` §3), for every algorithm.

The union of all clients' data never changes: a shift only moves samples between clients (or,
for ``incremental``, releases more of a client's own training data). Who holds which sample is
part of the state (``state.algo['shift']``: the owner of every training and test sample, and
which training samples are released), so a resumed run sees exactly the data the uninterrupted
run saw. ``RunContext.data`` is a view of the partitioned data (``RunContext.base_data``) built
from that state; it is rebuilt only when the ownership changes.

Once per round, after client selection and before any clustering step (``rounds.select_stage``;
in a multi-cycle round, FedCluster's, in its first cycle: the round is shifted once and its
cycles all train on the shifted data, and a run resumed mid-round keeps the shift its state holds):

- ``swap_all``: the clients of the algorithm's ``shift_pool`` (every federating client; FlexCFL:
  the clients already in a group) are randomly permuted and paired (position i with −(i+1));
  each pair swaps with ``shift.probability`` and exchanges its entire training and test sets.
- ``swap_part``: pairing as above; in a swapping pair, c1 picks a random label it holds (in
  both its training and test data) that c2 lacks, and c2 one the other way round; each gives the
  other all its samples of that label, training and test. A pair without such labels is
  skipped (``shift.mode=code_faithful``: it ends the round's swaps, as the official code's
  early ``return`` does).
- ``incremental``: every client's training data is shuffled once; the first ``release`` of it
  is available at first, and ``release`` more every ``every`` rounds (1/4, 1/2, 3/4, all at
  rounds 0, 50, 100, 150 by default). ``code_faithful`` computes each size from the current
  size, not the original one (the official code's bug: 1/4, 1/8, 3/32, 3/32 of the data).

Random draws come from (seed, round, "shift") and (seed, client, "shift/incremental"). The
ground-truth group of a client is the majority group of the samples it holds now, so ARI and
NMI follow the data. Each round logs ``clients_shifted``.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np
import torch

from flockfl.engine.data import ClientData, Split
from flockfl.rng import np_rng
from flockfl.stages.base import Stage
from flockfl.state import log_round

KEY = "shift"


def active(cfg) -> bool:
    return cfg.shift.kind != "none"


def initial(base: ClientData) -> dict[str, torch.Tensor]:
    """No shift yet: every sample with the client it was partitioned to, all released."""
    return {
        "train_owner": torch.from_numpy(owners_of(base.train)),
        "test_owner": torch.from_numpy(owners_of(base.test)),
        "released": torch.ones(int(base.train.offsets[-1]), dtype=torch.bool),
    }


def owners_of(split: Split) -> np.ndarray:
    return np.repeat(np.arange(len(split.offsets) - 1), np.diff(split.offsets)).astype(np.int64)


# ---------------------------------------------------------------------- the view


def _key(sh: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha1()
    for name in ("train_owner", "test_owner", "released"):
        h.update(sh[name].numpy().tobytes())
    return h.hexdigest()


def _split_view(split: Split, owner: np.ndarray, keep: Optional[np.ndarray], clients: int) -> Split:
    idx = np.arange(len(owner)) if keep is None else np.flatnonzero(keep)
    idx = idx[np.argsort(owner[idx], kind="stable")]  # by client, each client's samples in stored order
    offsets = np.concatenate([[0], np.cumsum(np.bincount(owner[idx], minlength=clients))]).astype(np.int64)
    t = torch.from_numpy(idx).to(split.x.device)
    return Split(split.x[t], split.y[t], offsets)


def view(base: ClientData, sh: dict[str, torch.Tensor]) -> ClientData:
    """The clients' data as the shift state says: samples regrouped by their current owner."""
    n = base.num_clients
    train_owner, test_owner = sh["train_owner"].numpy(), sh["test_owner"].numpy()
    train = _split_view(base.train, train_owner, sh["released"].numpy(), n)
    test = _split_view(base.test, test_owner, None, n)
    return ClientData(train, test, current_groups(base, train_owner), base.task, base.num_classes, base.input_shape,
                      base.server)


def current_groups(base: ClientData, train_owner: np.ndarray) -> np.ndarray:
    """Each client's ground-truth group: the majority group of the training samples it holds
    (its partitioned group when it holds none)."""
    sample_group = base.group[owners_of(base.train)]
    group = base.group.copy()
    if (base.group < 0).any():
        return group
    g = int(base.group.max()) + 1
    counts = np.zeros((base.num_clients, g), np.int64)
    np.add.at(counts, (train_owner, sample_group), 1)
    has = counts.sum(1) > 0
    group[has] = counts[has].argmax(1)
    return group


def sync(ctx, state) -> None:
    """Make ``ctx.data`` the view of ``state``'s shift (the partitioned data without one)."""
    sh = state.algo.get(KEY)
    key = _key(sh) if sh is not None else ""
    if getattr(ctx, "_shift_key", "") == key:
        return
    ctx.data = view(ctx.base_data, sh) if sh is not None else ctx.base_data
    ctx._shift_key = key
    ctx.data_version += 1


# ---------------------------------------------------------------------- the shifts


def release_level(cfg, round: int) -> int:
    return max(0, (round - cfg.shift.start_round) // cfg.shift.every)


def released_sizes(cfg, sizes: np.ndarray, level: int) -> np.ndarray:
    """Training samples each client has at release level ``level`` (0 = the first release)."""
    s = cfg.shift
    if s.mode == "paper_intent":
        return np.ceil(np.minimum(1.0, s.release * (level + 1)) * sizes - 1e-9).astype(np.int64)
    out = sizes.astype(np.int64)
    for lv in range(level + 1):  # the official code: ceil(current size · rate), so it shrinks
        out = np.ceil(out * min(1.0, s.release * (lv + 1)) - 1e-9).astype(np.int64)
    return out


def _incremental(cfg, base: ClientData, sh: dict, round: int, seed: int) -> tuple[dict, int]:
    sizes = base.train.sizes
    now = released_sizes(cfg, sizes, release_level(cfg, round))
    released = np.zeros(int(base.train.offsets[-1]), bool)
    for c in range(base.num_clients):  # each client's data is shuffled once, then released in that order
        order = np_rng(seed, client=c, purpose="shift/incremental").permutation(int(sizes[c]))
        released[base.train.offsets[c] + order[: now[c]]] = True
    before = np.bincount(sh["train_owner"].numpy()[sh["released"].numpy()], minlength=base.num_clients)
    changed = int((before != np.bincount(owners_of(base.train)[released], minlength=base.num_clients)).sum())
    return {**sh, "released": torch.from_numpy(released)}, changed


def _pairs(pool: np.ndarray, rng: np.random.Generator) -> list[tuple[int, int]]:
    perm = rng.permutation(np.asarray(pool, np.int64))
    return [(int(perm[i]), int(perm[-(i + 1)])) for i in range(len(perm) // 2)]


def _swap_labels(y_train: np.ndarray, y_test: np.ndarray, tr: np.ndarray, te: np.ndarray, a: int, b: int,
                 rng: np.random.Generator) -> Optional[tuple[int, int]]:
    """(label a gives, label b gives) for swap_part, or None when either has no exclusive label."""
    def labels(c: int, both: bool) -> set:
        s_tr, s_te = set(np.unique(y_train[tr == c]).tolist()), set(np.unique(y_test[te == c]).tolist())
        return s_tr & s_te if both else s_tr | s_te

    give_a = sorted(labels(a, True) - labels(b, False))
    give_b = sorted(labels(b, True) - labels(a, False))
    if not give_a or not give_b:
        return None
    return int(rng.choice(give_a)), int(rng.choice(give_b))


def _swaps(cfg, base: ClientData, sh: dict, pool: np.ndarray, round: int, seed: int) -> tuple[dict, int]:
    rng = np_rng(seed, round, purpose="shift")
    tr, te = sh["train_owner"].numpy().copy(), sh["test_owner"].numpy().copy()
    y_train, y_test = base.train.y.cpu().numpy(), base.test.y.cpu().numpy()
    moved = set()
    for a, b in _pairs(pool, rng):
        if rng.random() >= cfg.shift.probability:
            continue
        if cfg.shift.kind == "swap_all":
            for own in (tr, te):
                in_a, in_b = own == a, own == b
                own[in_a], own[in_b] = b, a
        else:
            picked = _swap_labels(y_train, y_test, tr, te, a, b, rng)
            if picked is None:
                if cfg.shift.mode == "code_faithful":
                    break
                continue
            la, lb = picked
            for own, y in ((tr, y_train), (te, y_test)):
                from_a, from_b = (own == a) & (y == la), (own == b) & (y == lb)
                own[from_a], own[from_b] = b, a
        moved.update((a, b))
    return {**sh, "train_owner": torch.from_numpy(tr), "test_owner": torch.from_numpy(te)}, len(moved)


def apply(ctx, algorithm, state, round: int):
    """The round's shift (after selection, before any clustering step): returns the new state,
    with ``clients_shifted`` in the round's log, and makes ``ctx.data`` its view."""
    cfg = ctx.cfg
    if not active(cfg):
        return state
    sh = state.algo.get(KEY)
    if sh is None:
        sh = initial(ctx.base_data)
    if round < cfg.shift.start_round and cfg.shift.kind != "incremental":
        shifted = 0
    elif cfg.shift.kind == "incremental":
        sh, shifted = _incremental(cfg, ctx.base_data, sh, round, ctx.seed)
    else:
        pool = np.intersect1d(algorithm.shift_pool(state, ctx), ctx.seen)
        sh, shifted = _swaps(cfg, ctx.base_data, sh, pool, round, ctx.seed)
    state = state.replace(algo={**state.algo, KEY: sh}, meta=dict(state.meta))
    log_round(state, clients_shifted=shifted)
    sync(ctx, state)
    return state


class Shift(Stage):
    """The ``shift`` section: the round's client-level distribution shift."""

    name = "shift"
    paper = "Duan et al., Flexible Clustered Federated Learning for Client-Level Data Distribution Shift (FlexCFL, TPDS 2022)"

    @classmethod
    def active(cls, cfg) -> bool:
        return active(cfg)

    def __init__(self, cfg, model=None):
        self.cfg = cfg

    def sync(self, ctx, state) -> None:
        sync(ctx, state)

    def after_select(self, ctx, algorithm, state, round: int):
        """The round's shift (the driver calls this once per round, whatever its cycles)."""
        return apply(ctx, algorithm, state, round)


def union_check(base: ClientData, data: ClientData) -> bool:
    """True when ``data`` holds exactly the samples of ``base`` (as a multiset of rows)."""
    def rows(split: Split) -> np.ndarray:
        flat = torch.cat([split.x.reshape(len(split.x), -1).cpu(), split.y.reshape(-1, 1).to(split.x.dtype).cpu()], 1)
        return np.sort(np.ascontiguousarray(flat.numpy()).view(f"V{flat.shape[1] * flat.element_size()}").ravel())

    return all(np.array_equal(rows(a), rows(b)) for a, b in ((base.train, data.train), (base.test, data.test)))


__all__ = ["KEY", "active", "apply", "initial", "release_level", "released_sizes", "sync", "union_check", "view"]
