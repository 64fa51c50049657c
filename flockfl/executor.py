"""Training shards on Dask workers (``executor.kind=dask``): what a shard job carries, and the
worker side that runs it.

A job carries only its shard: the client ids and per-client rows of the :class:`LocalSpec`
(initial parameters, corrections, masks, schedule), the engine and the round, plus what
identifies the data: the validated config, the partition's content hash, the directory the
worker reads partitions from, and the distribution-shift ownership (``state.algo['shift']``)
when a shift is configured. A worker builds its :class:`RunContext` once per (partition hash,
context key) with :func:`flockfl.preparation.prepare` (the raw dataset plus the content-addressed
partition file) and keeps it; the dataset never travels with a task.

Jobs and results cross the wire as pickled bytes (``pack``/``run_job``), so the flow knows
exactly how many bytes each round moves. A worker on a GPU re-splits a shard that would not fit
in the GPU's free memory (:func:`shard_size_for`).

Fault injection for drills: ``FLOCKFL_KILL_WORKER_AT=<round>:<sentinel file>`` makes the first
worker that starts a shard of round ``<round>`` (0-based) create the sentinel file and SIGKILL
itself; later attempts (Dask reschedules the shard on another worker) see the file and train.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import pickle
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch

from flockfl.config import ExperimentConfig
from flockfl.errors import ConfigError, ExecutorError
from flockfl.engine import LocalSpec, TrainResult

KILL_ENV = "FLOCKFL_KILL_WORKER_AT"
CACHE_SIZE = 2  # run contexts a worker keeps (each holds its dataset)
# bytes a client's training holds per model parameter (fp32 parameters, gradients, initial
# parameters / anchor / correction / momentum, vmap temporaries) and per activation of a sample
PARAM_COPIES = 6
ACTIVATION_COPIES = 3


@dataclass
class ShardJob:
    config: dict  # the validated config (model_dump)
    context_key: str  # :func:`context_key` of the config
    data_root: str  # absolute: where the worker finds the partition file
    partition_hash: str  # the partition the flow trains on (content hash)
    shift: Optional[dict]  # state.algo['shift'] (sample ownership) or None: the partitioned data
    spec: LocalSpec  # this shard's clients only
    engine: str
    round: int
    threads: int = 1  # torch intra-op threads on the worker
    gpu_memory_fraction: float = 0.8


def context_key(cfg: ExperimentConfig) -> str:
    """What a worker's run context depends on: the config without ``executor`` and ``tracking``."""
    d = cfg.model_dump()
    d.pop("executor", None)
    d.pop("tracking", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------- payloads


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage no larger than what it spans.

    Pickling a tensor pickles its whole storage: a shard's rows sliced from the cohort's
    stacked tensor would carry every client's rows. A broadcast tensor (stride 0, FedAvg's
    initial model) stays broadcast."""
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    if t.untyped_storage().nbytes() <= span * t.element_size():
        return t
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride())


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj


_SPEC_TENSORS = ("init", "prox_anchor", "correction", "momentum_init", "masks", "meta", "order")


def map_spec(spec: LocalSpec, fn) -> LocalSpec:
    second = spec.second and dataclasses.replace(spec.second, rows=_map_tensors(spec.second.rows, fn),
                                                 anchor=_map_tensors(spec.second.anchor, fn))
    return dataclasses.replace(spec, second=second, **{f: _map_tensors(getattr(spec, f), fn) for f in _SPEC_TENSORS})


def map_result(result: TrainResult, fn) -> TrainResult:
    return dataclasses.replace(result, params=_map_tensors(result.params, fn), meta=_map_tensors(result.meta, fn))


def pack(job: ShardJob) -> bytes:
    """The job as bytes (cloudpickle: a spec may carry a closure), its tensors compacted."""
    import cloudpickle

    job = dataclasses.replace(job, spec=map_spec(job.spec, compact))
    return cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_result(payload: bytes, device: torch.device) -> tuple[TrainResult, dict]:
    result, info = pickle.loads(payload)
    if device.type != "cpu":
        result = map_result(result, lambda t: t.to(device))
    return result, info


# ---------------------------------------------------------------------- GPU sizing


def shard_size_for(free_bytes: int, client_bytes: int, shard_size: int, fraction: float = 0.8) -> int:
    """The largest shard (≤ ``shard_size``, ≥ 1) whose clients fit in ``fraction`` of
    ``free_bytes`` at ``client_bytes`` each."""
    if client_bytes <= 0:
        return shard_size
    return max(1, min(shard_size, int(free_bytes * fraction) // int(client_bytes)))


def activation_numel(model: torch.nn.Module, sample_shape: tuple) -> int:
    """Output elements of every leaf module for one sample (a forward pass with hooks)."""
    total = [0]

    def hook(_m, _inp, out):
        if isinstance(out, torch.Tensor):
            total[0] += out.numel()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        dev = next(model.parameters()).device
        with torch.no_grad():
            model(torch.zeros((1, *sample_shape), device=dev))
    finally:
        for h in handles:
            h.remove()
    return total[0]


def client_bytes(num_params: int, activations: int, sample_numel: int, batch_size: int,
                 param_copies: int = PARAM_COPIES, activation_copies: int = ACTIVATION_COPIES) -> int:
    """Estimated device memory one client of a vectorised shard needs (fp32): its copies of the
    parameters, and a batch of samples with their activations (forward and backward)."""
    return 4 * (param_copies * num_params + batch_size * (sample_numel + activation_copies * activations))


# ---------------------------------------------------------------------- the worker side

_CACHE: "OrderedDict[tuple[str, str], dict]" = OrderedDict()
_LOCK = threading.Lock()


def _load(job: ShardJob) -> dict:
    """The worker's run context for the job's (partition, config), built once and cached."""
    key = (job.partition_hash, job.context_key)
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        from flockfl import rounds
        from flockfl.experiments import validate
        from flockfl.data.store import load_partition, partition_path

        cfg = validate(job.config)
        path = partition_path(cfg, job.data_root)
        where = _worker_name()
        if not path.exists():
            raise ExecutorError(f"executor.data_root: worker {where} cannot read the partition {job.partition_hash[:16]}… "
                                f"({path} does not exist); copy data/partitions there or point executor.data_root at "
                                "a directory the workers can read")
        stored = load_partition(path).content_hash
        if stored != job.partition_hash:
            raise ExecutorError(f"executor.data_root: worker {where} found partition {stored[:16]}… at {path}, "
                                f"not the flow's {job.partition_hash[:16]}…; sync the worker's partitions directory")
        try:  # load only: a worker never writes a partition into the shared directory
            prep = rounds.prepare(cfg, job.data_root, build=False, inputs=False)  # the files are the driver's
        except ConfigError as err:  # missing data files, or raw data that does not match the partition
            raise ExecutorError(f"worker {where}: {err}") from None
        if prep.partition_hash != job.partition_hash:  # same file, other raw data on this worker
            raise ExecutorError(f"dataset: worker {where} loads a different {cfg.dataset.name!r} dataset (partition "
                                f"{prep.partition_hash[:16]}…, the flow's is {job.partition_hash[:16]}…); give the "
                                "workers the same data files")
        ctx = prep.ctx
        entry = {"ctx": ctx, "stages": prep.stages, "views": {}, "device": ctx.data.train.x.device}
        if entry["device"].type == "cuda":
            sample = tuple(ctx.data.input_shape)
            entry["client_bytes"] = client_bytes(sum(p.numel() for p in ctx.model.parameters()),
                                                 activation_numel(ctx.model, sample), math.prod(sample),
                                                 cfg.train.batch_size)
        _CACHE[key] = entry
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
        return entry


def _context(entry: dict, sh: Optional[dict]):
    """The run context with the data view of the shift state ``sh`` (a shallow copy when
    shifted: tasks running side by side on one worker never share a mutated context)."""
    ctx = entry["ctx"]
    if sh is None:
        return ctx
    from flockfl.stages import shift

    key = shift._key(sh)
    if key not in entry["views"]:
        view = copy.copy(ctx)
        shift.sync(view, SimpleNamespace(algo={shift.KEY: sh}))
        entry["views"] = {key: view}  # one view at a time: a round's shards share it
    return entry["views"][key]


def _worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return f"pid {os.getpid()}"


def maybe_kill_worker(round: int) -> None:
    """The worker-kill drill (``FLOCKFL_KILL_WORKER_AT=<round>:<sentinel>``): die hard on the
    first attempt at a shard of ``round``; the sentinel file lets every later attempt train."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    at, _, sentinel = spec.partition(":")
    if int(at) != round or not sentinel:
        return
    try:
        fd = os.open(sentinel, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()} {_worker_name()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def run_job(payload: bytes) -> bytes:
    """Worker entry point: train one shard; returns the pickled (TrainResult, info).

    On a GPU, a shard larger than what fits in ``gpu_memory_fraction`` of the free memory is
    trained in pieces (each client's training does not depend on its shard-mates)."""
    from flockfl import training

    t0 = time.perf_counter()
    job: ShardJob = pickle.loads(payload)
    entry = _load(job)
    torch.set_num_threads(job.threads)
    ctx = _context(entry, job.shift)
    device = entry["device"]
    spec = map_spec(job.spec, lambda t: t.to(device)) if device.type != "cpu" else job.spec
    maybe_kill_worker(job.round)
    n = len(spec.clients)
    size = n
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        size = shard_size_for(free, entry["client_bytes"], n, job.gpu_memory_fraction)
    stages = tuple(entry["stages"].values())
    parts = [training.train_shard(ctx, s, job.engine, job.round, stages) for s in training.split_spec(spec, size)]
    result = TrainResult.concat(parts)
    result = map_result(result, lambda t: compact(t.detach().cpu()))
    info = {"pieces": len(parts), "device": str(device), "seconds": time.perf_counter() - t0, "worker": _worker_name()}
    return pickle.dumps((result, info), protocol=pickle.HIGHEST_PROTOCOL)


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


__all__ = ["ExecutorError", "ShardJob", "activation_numel", "client_bytes", "clear_cache", "compact", "context_key",
           "maybe_kill_worker", "pack", "run_job", "shard_size_for", "unpack_result"]
