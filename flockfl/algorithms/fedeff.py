"""FedEff — Narmadha & Varalakshmi, "FedEff: efficient federated learning with optimal local
epochs for heterogeneous clients" (seed 000; spec §3.5).

From each client's timing profile (σ_i seconds per epoch, β_i download, δ_i upload; here
from the simulated system model, :mod:`flockfl.system`) the server fixes, once:

    E   = τ·E_b                                  (τ = ``algorithm.edf``, E_b = ``train.local_epochs``)
    ERT = ⌈E·σ_a + β_a + δ_a⌉                    (estimated round time; σ_a, β_a, δ_a are means)
    CT_i = ERT − (β_i + δ_i),   E_i = ⌊CT_i / σ_i⌋   (at least 1: a too-slow client overruns ERT)

so every client fills the same round time: fast clients train more epochs, slow ones fewer.
Aggregation is FedAvg's sample-weighted mean. The profile, E_i and ERT live in the state, so
a resume never re-times the clients. Deviation: the paper measures the profile in an extra
pre-training round; here the simulated profile is known up front, so no round is spent on it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import real, weighting
from flockfl.engine.functional import num_params


def fedeff_epochs(sigma, beta, delta, base_epochs: float, edf: float, min_epochs: int = 1):
    """(E_i, ERT, CT_i) of FedEff's initialisation round (spec §3.5, steps 3–6)."""
    sigma, beta, delta = (np.asarray(a, dtype=np.float64) for a in (sigma, beta, delta))
    e = edf * base_epochs
    ert = math.ceil(e * sigma.mean() + beta.mean() + delta.mean() - 1e-9)  # tolerance: 26.000000000000004 → 26
    ct = ert - (beta + delta)
    epochs = np.floor(ct / sigma + 1e-9).astype(np.int64)
    return np.maximum(epochs, min_epochs), ert, ct


class FedEff(Algorithm):
    name = "fedeff"
    paper = "FedEff: per-client local epochs that fill an estimated round time (seed 000)"
    hyperparameters = (
        weighting("samples", source="paper", note="Alg. 2: GW_r = Σ_i (n_i/n) LW_i"),
        real("edf", 0.5, "epoch-deciding factor: ERT is set by edf·E_b epochs of the mean client", "τ", gt=0, le=1,
             source="library", note="the paper's value is not recoverable from the seed (spec §3.5)"),
    )

    def init_state(self, ctx):
        state = super().init_state(ctx)
        t = self.cfg.train
        model_mb = num_params(state.models) * 4 / 1e6
        sigma = ctx.system.epoch_seconds(ctx.data.train.sizes, t.batch_size)
        beta, delta = ctx.system.link_seconds(model_mb)
        epochs, ert, _ = fedeff_epochs(sigma, beta, delta, t.local_epochs, float(self.hp("edf")))
        return state.replace(meta={**state.meta, "fedeff_ert": ert}, algo={"epochs": torch.from_numpy(epochs), "sigma": torch.from_numpy(sigma),
                                   "beta": torch.from_numpy(beta), "delta": torch.from_numpy(delta)})

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        spec.client_epochs, spec.steps = state.algo["epochs"].numpy()[clients], None
        return spec
