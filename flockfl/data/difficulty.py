"""Partition difficulty (thesis Algorithm 2, spec §1.7): rebuild any label-skewed partition so
that each client keeps its exact class counts while the *difficulty* of its samples varies.

``partition.difficulty_fraction`` = f_ord ∈ [0, 1] turns it on after the scheme has run:

1. An expert θ_E (``partition.difficulty_model``, trained centrally on the whole training
   set for ``partition.difficulty_epochs`` epochs from the (seed, "difficulty_expert")
   streams; mini-batch SGD, batch 64, lr 0.1) scores every training sample by its loss.
2. For each class c its samples are sorted by loss (easiest first); client i takes the
   contiguous block ``D_c[id[i,c] : id[i,c] + round(f_ord·N[i,c])]`` where ``id`` is the
   *exclusive* cumulative sum of the class counts N[i,c] (the seed prints ``cumsum``).
3. The rest of each client's class-c count is drawn at random, without replacement, from
   the class-c samples step 2 left (the (seed, "difficulty") stream).

f_ord = 1 gives contiguous difficulty blocks (client 0 easiest: high consistency); f_ord = 0
is a random re-draw with the same counts (the thesis's default, low consistency). Test sets
are unchanged (their class proportions follow the unchanged counts). The partition's info
records each client's mean and std of expert loss (§1.6's consistency measure).
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.rng import np_rng, torch_generator


def expert_losses(ds, model_name: str, epochs: int, seed: int) -> np.ndarray:
    """Per-sample training loss under a centrally trained expert (deterministic given seed)."""
    from flockfl.engine.functional import per_sample_loss
    from models import build_model, init_params

    x = torch.as_tensor(ds.x_train, dtype=torch.float32)
    y = torch.as_tensor(ds.y_train, dtype=torch.long)
    model = build_model(model_name, ds.input_shape, ds.num_outputs)
    with torch.no_grad():
        for name, p in init_params(model, torch_generator(seed, purpose="difficulty_expert/init")).items():
            model.get_parameter(name).copy_(p)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    order = np_rng(seed, purpose="difficulty_expert")
    model.train()
    for _ in range(epochs):
        perm = order.permutation(len(y))
        for a in range(0, len(y), 64):
            idx = torch.from_numpy(perm[a : a + 64])
            opt.zero_grad()
            per_sample_loss(model(x[idx]), y[idx], "classification").mean().backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        if hasattr(model, "channel_groups"):  # BN: statistics of the whole training set
            from flockfl.engine.data import Split
            from flockfl.engine.trainers import calibrate_bn

            params = {n: p.detach().clone().unsqueeze(0) for n, p in model.named_parameters()}
            split = Split(x, y, np.array([0, len(y)]))
            calibrate_bn(model, params, split, np.array([0]))
            for n, p in params.items():
                model.get_parameter(n).copy_(p[0])
        out = torch.cat([model(x[a : a + 4096]) for a in range(0, len(y), 4096)])
        return per_sample_loss(out, y, "classification").numpy().astype(np.float64)


def reorder_by_difficulty(train_idx: list[np.ndarray], y: np.ndarray, loss: np.ndarray, f_ord: float,
                          rng: np.random.Generator, exclude: np.ndarray | None = None) -> list[np.ndarray]:
    """Algorithm 2: new train indices with the same per-client class counts (samples in
    ``exclude``, the server's hold-out, are never dealt)."""
    usable = np.ones(len(y), bool)
    if exclude is not None and len(exclude):
        usable[exclude] = False
    n = len(train_idx)
    classes = np.unique(y[np.concatenate(train_idx)]) if n else np.zeros(0, np.int64)
    counts = np.array([[int((y[idx] == c).sum()) for c in classes] for idx in train_idx])  # N[i, c]
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for ci, c in enumerate(classes):
        pool = np.flatnonzero((y == c) & usable)
        d_c = pool[np.argsort(loss[pool], kind="stable")]  # easiest first
        start = np.concatenate([[0], np.cumsum(counts[:, ci])[:-1]])  # exclusive cumsum
        ordered = np.rint(f_ord * counts[:, ci]).astype(int)
        taken = np.zeros(len(d_c), bool)
        for i in range(n):
            block = np.arange(start[i], start[i] + ordered[i])
            parts[i].append(d_c[block])
            taken[block] = True
        rest = rng.permutation(d_c[~taken])
        at = 0
        for i in range(n):
            m = counts[i, ci] - ordered[i]
            parts[i].append(rest[at : at + m])
            at += m
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def apply(part, ds, cfg, seed: int):
    """Rebuild ``part``'s training indices by Algorithm 2 (in place); returns the partition."""
    pc = cfg.partition
    loss = expert_losses(ds, pc.difficulty_model, pc.difficulty_epochs, seed)
    new = reorder_by_difficulty(part.train_idx, np.asarray(ds.y_train), loss, pc.difficulty_fraction,
                                np_rng(seed, purpose="difficulty"), part.server_idx)
    part.train_idx = new
    per_client = [loss[i] for i in new]
    part.info = {**part.info, "difficulty": {
        "f_ord": pc.difficulty_fraction, "expert": pc.difficulty_model, "expert_epochs": pc.difficulty_epochs,
        "client_loss_mean": [float(v.mean()) if len(v) else 0.0 for v in per_client],
        "client_loss_std": [float(v.std()) if len(v) else 0.0 for v in per_client],
        "consistency_std_mean": float(np.mean([v.std() for v in per_client if len(v)]))}}
    return part
