"""The core lease of each run this process runs (``flockfl.cores``; not on CUDA): requested
while the run sets up (:func:`flows.experiment.execute`), waited for before its rounds (the
flow), released when they end, and what the wait was (the summary's ``cores_wait_s``,
``cores_queued_s`` and ``cores_leased``)."""

from __future__ import annotations

from flockfl import cores
from flockfl.config import ExperimentConfig
from flows.run_clock import timed
from flows.rundir import run_key

_LEASES: dict[str, cores.Lease] = {}  # run dir -> its core lease, queued by execute, waited for by the flow


def request_cores(cfg: ExperimentConfig, run_dir) -> None:
    """Queue for the cores of this run's threads (``flockfl.cores``; not on CUDA) while it sets up."""
    import torch

    from flockfl.engine.runtime import resolve_threads

    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return
    lease = cores.request(resolve_threads(cfg.train.threads), f"flockfl run {cfg.name}")
    if lease:
        _LEASES[run_key(run_dir)] = lease


def wait_for_cores(run_dir, phases: dict) -> dict:
    lease = _LEASES.get(run_key(run_dir))
    if lease is None:
        return {"cores_wait_s": 0.0, "cores_queued_s": 0.0, "cores_leased": []}
    with timed(phases, "cores_wait"):
        waited = lease.wait()
    return {"cores_wait_s": waited, "cores_queued_s": lease.queued_s, "cores_leased": lease.granted}


def release_cores(run_dir) -> None:
    lease = _LEASES.pop(run_key(run_dir), None)
    if lease:
        lease.release()
