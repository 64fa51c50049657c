"""Local batch schedules: which samples each client uses at each local step.

Both trainers consume the same schedule, so they see identical data orders. A client's
order comes from the stream (seed, round, client, "shuffle") alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from flockfl.engine.pacing import Pacing, paced_batches
from flockfl.rng import np_rng


@dataclass(frozen=True)
class LrSchedule:
    """The local learning rate of each step, shared by both trainers (``train.lr_schedule``).

    Step i counts from 0 within one local training (a round's, or a fine-tuning pass), so the
    rate is reset every round; r is the round. ``constant``: η₀. ``inverse``: η₀(1 + α·i)^−b (the
    curriculum thesis §2.8, Caffe's "inv"). ``step``: η₀·γ^⌊r/every⌋ (a decay by round)."""

    kind: str = "constant"
    alpha: float = 0.001
    b: float = 0.75
    gamma: float = 0.99
    every: int = 1

    def rates(self, lr: float, round: int, steps: int) -> list[float]:
        """The rate of every local step 0..steps−1 in ``round`` (a negative round, a pass before
        round 0, counts as round 0)."""
        if self.kind == "inverse":
            return [float(lr * (1.0 + self.alpha * i) ** -self.b) for i in range(steps)]
        if self.kind == "step":
            return [float(lr * self.gamma ** (max(round, 0) // self.every))] * steps
        return [float(lr)] * steps


@dataclass
class SecondPass:
    """A second pass of local training that each train shard runs after the round's, on the same
    clients and with the shard's spec (Ditto's personal v-pass, APFL's (v, α) pass): the
    algorithm registered as ``method`` runs it (its ``second_pass(model, spec, data, task,
    engine, seed, round)``, a static method) and returns each client's new row. The rows and the
    anchor are stacked per client and follow the shard (``restrict``)."""

    method: str  # the registry name (``algorithm.name``) of the algorithm whose ``second_pass`` runs it
    rows: dict[str, torch.Tensor]  # where each client's pass starts (Ditto: v_k; APFL: v_i and α_i)
    anchor: Optional[dict[str, torch.Tensor]] = None  # a point each client is pulled to (Ditto: w^t)
    settings: dict = dataclasses.field(default_factory=dict)  # the method's knobs (plain values: λ, epochs, stream)


@dataclass
class LocalSpec:
    """How the selected clients train this round (from ``Algorithm.local_spec``)."""

    clients: np.ndarray  # client ids, in cohort order
    init: dict[str, torch.Tensor]  # stacked initial parameters, leading axis = clients
    lr: float
    epochs: int = 1
    steps: Optional[int] = None  # fixed local steps (overrides epochs)
    batch_size: int = 10
    full_batch: bool = False
    meta: Optional[dict] = None  # algorithm-specific facts the cluster/aggregate hooks need
    # per-client local work (FedNova's τ_i, CC-FL, FedEff): overrides epochs / steps per client
    client_epochs: Optional[np.ndarray] = None
    client_steps: Optional[np.ndarray] = None
    # additive gradient terms: μ(w − anchor) (FedProx) and a per-client constant (SCAFFOLD's c − c_i)
    prox_mu: float | dict[str, float] = 0.0  # a dict gives each parameter its own μ (FedAC: μ + λ on the embedding)
    prox_anchor: Optional[dict[str, torch.Tensor]] = None  # stacked; default: the initial params
    # each client's own μ per parameter ([clients] rows, overriding ``prox_mu``): cells of a stack whose
    # μ differ (FedAvg's 0 beside FedProx's μ; flockfl.engine.stacking), read by the vectorised trainer
    client_mu: Optional[dict[str, torch.Tensor]] = None
    correction: Optional[dict[str, torch.Tensor]] = None  # stacked per client
    momentum: float = 0.0  # local heavy-ball momentum ρ (buf ← ρ·buf + g), reset every round unless ``momentum_init``
    # stacked per client: the momentum buffer each client's pass starts from (``train.optimizer_state=persist``: the
    # buffer its last round left, from the server state; None = zeros, a fresh optimiser). When it is set, both
    # trainers return each client's final buffer in ``TrainResult.meta['momentum_buffer']`` (trained entries only)
    momentum_init: Optional[dict[str, torch.Tensor]] = None
    # where ``correction`` enters under momentum: False = into g before the buffer (accumulated);
    # True = added to the step after it (w ← w − η(buf + corr)), never accumulated (SCAFFOLD as
    # NIID-Bench's code runs it: torch's SGD step, then w ← w − η(c − c_i)). Same bits without momentum.
    correction_after_momentum: bool = False
    # L2 weight decay ω: g ← g + ω·w before every other term and the momentum (torch.optim.SGD's weight_decay)
    weight_decay: float = 0.0
    lr_schedule: LrSchedule = LrSchedule()  # the rate of each local step (train.lr_schedule)
    # a closed-form local solver (FedSplit's exact prox): (model, spec, data, task) → stacked params,
    # or (params, meta) with stacked per-client extras for TrainResult.meta (pFedMe's θ̃);
    # when set, both trainers use it instead of SGD
    solver: Optional[Callable] = None
    # the same update for the whole cohort at once (stacked parameters, one batched step for all),
    # which the vectorised trainer runs instead of ``solver`` where it is set (pFedMe's inner solve)
    solver_vectorized: Optional[Callable] = None
    # a second pass each shard runs after its training, on the same clients (Ditto's personal
    # v-pass, APFL's (v, α) pass): its result rides in the shard's ``TrainResult.meta['personal']``
    second: Optional["SecondPass"] = None
    # the purpose of the batch-order streams (seed, round, client, stream): "shuffle" for a
    # round's training, another name for extra passes (evaluation fine-tuning, newcomers)
    stream: str = "shuffle"
    # pruning (flockfl/stages/subfedavg.py): stacked per-client 0/1 masks of the masked parameters;
    # a masked weight's update is multiplied by its mask, so a pruned weight (0 in the init) stays 0
    masks: Optional[dict[str, torch.Tensor]] = None
    # per-client step count after which both trainers record the parameters
    # (``TrainResult.meta['snapshot']``: Sub-FedAvg's first-epoch mask)
    snapshot_steps: Optional[np.ndarray] = None
    # a data curriculum (flockfl/stages/curriculum.py): per client, its local sample indices in
    # curriculum order (easiest first for ``curr``); ``pacing`` says how many of them step t may use
    order: Optional[list] = None
    pacing: Optional[Pacing] = None

    @property
    def has_extras(self) -> bool:
        return self.has_prox or self.correction is not None or bool(self.momentum) or bool(self.weight_decay)

    def step_rates(self, round: int, steps: int) -> list[float]:
        """The learning rate of each of ``steps`` local steps in ``round``."""
        return self.lr_schedule.rates(self.lr, round, steps)

    @property
    def has_prox(self) -> bool:
        if self.client_mu is not None:
            return True
        return any(self.prox_mu.values()) if isinstance(self.prox_mu, dict) else bool(self.prox_mu)

    def mu_of(self, name: str) -> float:
        """The proximal weight of parameter ``name`` (0 for a name a per-parameter dict leaves out)."""
        return self.prox_mu.get(name, 0.0) if isinstance(self.prox_mu, dict) else self.prox_mu

    def work_of(self, position: int) -> tuple[int, Optional[int]]:
        """(epochs, steps) of the client at ``position`` in the cohort."""
        epochs = int(self.client_epochs[position]) if self.client_epochs is not None else self.epochs
        steps = int(self.client_steps[position]) if self.client_steps is not None else self.steps
        return epochs, steps


def client_batches(n: int, spec: LocalSpec, rng: np.random.Generator, position: int = 0) -> list[np.ndarray]:
    """Local sample indices of every step for one client of size ``n``."""
    epochs, steps = spec.work_of(position)
    if n == 0 or (steps is not None and steps == 0) or (steps is None and epochs == 0):
        return []
    if spec.full_batch:
        return [np.arange(n)] * (steps or epochs)
    b = min(spec.batch_size, n)
    if spec.order is not None:  # a data curriculum: the same budget of steps, paced prefixes
        budget = steps if steps is not None else epochs * -(-n // b)
        return paced_batches(np.asarray(spec.order[position]), spec.pacing or Pacing(), budget, b, rng)
    batches: list[np.ndarray] = []
    while True:
        perm = rng.permutation(n)
        batches.extend(perm[i : i + b] for i in range(0, n, b))
        if steps is None:
            if len(batches) >= epochs * -(-n // b):
                return batches
        elif len(batches) >= steps:
            return batches[:steps]


def cohort_schedule(spec: LocalSpec, sizes: np.ndarray, seed: int, round: int) -> list[list[np.ndarray]]:
    return [client_batches(int(sizes[c]), spec, np_rng(seed, round, int(c), spec.stream), i)
            for i, c in enumerate(spec.clients)]


@dataclass
class StackedSchedule:
    """A cohort schedule as tensors: step s of client c uses ``index[s, c, :]`` with
    per-sample weights ``weight[s, c, :]`` (1/batch size, 0 for padding)."""

    index: torch.Tensor  # [S, C, B] global sample indices
    weight: torch.Tensor  # [S, C, B]
    active: torch.Tensor  # [S, C] bool: the client takes a step

    @property
    def steps(self) -> int:
        return self.index.shape[0]

    def rows(self, positions: np.ndarray) -> "StackedSchedule":
        """The schedule of the clients at ``positions``, up to the last step one of them takes (the
        same padded width: each client's batches are the ones it has in the whole cohort)."""
        pos = torch.as_tensor(positions, dtype=torch.long)
        active = self.active[:, pos]
        last = int(active.any(1).nonzero().max()) + 1 if bool(active.any()) else 0
        return StackedSchedule(self.index[:last, pos], self.weight[:last, pos], active[:last])


def stack_schedule(batches: list[list[np.ndarray]], offsets: np.ndarray, clients: np.ndarray) -> StackedSchedule:
    c_count = len(batches)
    s_max = max((len(b) for b in batches), default=0)
    b_max = max((len(x) for b in batches for x in b), default=1)
    index = np.zeros((s_max, c_count, b_max), np.int64)
    weight = np.zeros((s_max, c_count, b_max), np.float32)
    active = np.zeros((s_max, c_count), bool)
    for ci, (cid, steps) in enumerate(zip(clients, batches)):
        base = offsets[cid]
        for s, local in enumerate(steps):
            index[s, ci, : len(local)] = base + local
            index[s, ci, len(local) :] = base  # padding points at a real sample, weight 0
            weight[s, ci, : len(local)] = 1.0 / len(local)
            active[s, ci] = True
    return StackedSchedule(torch.from_numpy(index), torch.from_numpy(weight), torch.from_numpy(active))


def restrict(spec: LocalSpec, positions) -> LocalSpec:
    """The spec of the clients at ``positions`` (an index array or a slice) of the cohort;
    every per-client field follows."""
    n = len(spec.clients)
    pos_t = positions if isinstance(positions, slice) else torch.as_tensor(positions, dtype=torch.long)

    def rows(d):  # a slice keeps views (a broadcast init stays broadcast)
        return None if d is None else {k: v[pos_t] for k, v in d.items()}

    def per_client(v):
        if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n for t in v.values()):
            return rows(v)  # stacked per-client tensors (the pruning stage's mask rows)
        return v[positions] if isinstance(v, np.ndarray) and len(v) == n else v

    def listed(v):
        if v is None:
            return None
        return v[positions] if isinstance(positions, slice) else [v[int(i)] for i in positions]

    return dataclasses.replace(
        spec, clients=spec.clients[positions], init=rows(spec.init), prox_anchor=rows(spec.prox_anchor),
        client_mu=rows(spec.client_mu),
        correction=rows(spec.correction), momentum_init=rows(spec.momentum_init),
        client_epochs=per_client(spec.client_epochs), client_steps=per_client(spec.client_steps),
        meta={k: per_client(v) for k, v in (spec.meta or {}).items()},
        masks=rows(spec.masks), snapshot_steps=per_client(spec.snapshot_steps), order=listed(spec.order),
        second=None if spec.second is None else dataclasses.replace(
            spec.second, rows=rows(spec.second.rows), anchor=rows(spec.second.anchor)),
    )


def split_spec(spec: LocalSpec, shard_size: int) -> list[LocalSpec]:
    """Shards of the cohort, each a vectorised batch of up to ``shard_size`` clients
    (none for an empty cohort: under CC-FL a round can have no participants)."""
    n = len(spec.clients)
    if n == 0:
        return []
    if n <= shard_size:
        return [spec]
    return [restrict(spec, slice(a, min(n, a + shard_size))) for a in range(0, n, shard_size)]
