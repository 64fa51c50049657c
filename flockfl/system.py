"""Simulated system heterogeneity: per-client compute and link speeds, and round times.

Every client i gets a compute power CP_i (batches per second), a per-batch overhead γ_i, and
download/upload bandwidths (MB/s). They are drawn once, deterministically, from the
(seed, client, "system") stream: lognormal around the configured medians, or set per client.
From them (FedEff's timing model, spec §3.5):

    σ_i = (n_i / b)(1/CP_i + γ_i)      seconds per local epoch
    β_i = model_MB / down_i,  δ_i = model_MB / up_i     download / upload seconds

A client that took K local steps (batches) spends K (1/CP_i + γ_i) computing. A synchronous
round lasts as long as its slowest selected client: ``sim_round_time`` = max_i(compute_i +
β_i + δ_i). ``sim_time`` is the running sum, so runs can be compared by simulated
time-to-accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flockfl.config import SystemConfig
from flockfl.rng import np_rng


@dataclass
class SystemProfile:
    cp: np.ndarray  # batches per second
    gamma: np.ndarray  # seconds of overhead per batch
    down: np.ndarray  # MB/s
    up: np.ndarray  # MB/s

    def step_seconds(self) -> np.ndarray:
        return 1.0 / self.cp + self.gamma

    def epoch_seconds(self, sizes: np.ndarray, batch: int) -> np.ndarray:
        """σ_i = (n_i / b)(1/CP_i + γ_i)."""
        return np.ceil(np.asarray(sizes) / batch) * self.step_seconds()

    def link_seconds(self, model_mb: float) -> tuple[np.ndarray, np.ndarray]:
        """(β_i, δ_i): download and upload seconds of one model."""
        return model_mb / self.down, model_mb / self.up

    def round_time(self, clients: np.ndarray, steps: np.ndarray, down_mb: float, up_mb: float) -> float:
        """The slowest selected client's compute plus communication (MB each way per client)."""
        if len(clients) == 0:
            return 0.0
        t = steps * self.step_seconds()[clients] + down_mb / self.down[clients] + up_mb / self.up[clients]
        return float(t.max())


def _draw(seed: int, n: int, median: float, sigma: float, given: list[float] | None, purpose: str) -> np.ndarray:
    if given is not None:
        return np.asarray(given, dtype=np.float64)
    if sigma == 0:
        return np.full(n, float(median))
    return np.array([median * np.exp(sigma * np_rng(seed, client=i, purpose=purpose).standard_normal()) for i in range(n)])


def make_profile(cfg: SystemConfig, seed: int, num_clients: int) -> SystemProfile:
    return SystemProfile(
        cp=_draw(seed, num_clients, cfg.compute_median, cfg.compute_sigma, cfg.client_compute, "system/compute"),
        gamma=np.full(num_clients, cfg.batch_overhead),
        down=_draw(seed, num_clients, cfg.bandwidth_median, cfg.bandwidth_sigma, cfg.client_down, "system/down"),
        up=_draw(seed, num_clients, cfg.bandwidth_median, cfg.bandwidth_sigma, cfg.client_up, "system/up"),
    )
