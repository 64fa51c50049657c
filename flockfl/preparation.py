"""A run made ready: the data loaded, the partition built or loaded (content-addressed), the
model, the algorithm, the active stages and the files they name, checked against each other.

:func:`prepare` is what the flow's first task, the plain loop and Dask's workers call;
:func:`prepare_data` runs on client data built elsewhere. :mod:`flockfl.rounds` re-exports them
(scripts import them from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from flockfl.algorithms import Algorithm, build_algorithm
from flockfl.config import ExperimentConfig, classifier_list
from flockfl.context import RunContext, unseen_clients
from flockfl.data import build_client_data, build_or_load, load_dataset
from flockfl.engine.data import ClientData
from flockfl.engine import configure_threads, resolve_device
from flockfl.errors import ConfigError
from flockfl.eval_protocol import check_protocol
from flockfl.inputs import Reader, read_inputs
from flockfl.stages import build_stages
from models import build_model


@dataclass
class PreparedRun:
    cfg: ExperimentConfig
    ctx: RunContext
    algorithm: Algorithm
    partition_path: Path
    partition_hash: str
    partition_cached: bool
    threads: int
    info: dict = field(default_factory=dict)
    # the stages this run uses (curriculum, pruning, shift), by name, in hook order
    stages: dict = field(default_factory=dict)


def prepare(cfg: ExperimentConfig, partitions_root: str | Path = "data/partitions", build: bool = True,
            readers: Optional[dict[str, Reader]] = None, inputs: bool = True) -> PreparedRun:
    """Load the data, build or load the partition (content-addressed cache), and the model
    (``build=False``: only load the partition; a missing or stale one is a ConfigError); the
    files the config names with ``readers`` for model URIs (``inputs=False``: none, a worker's)."""
    threads = configure_threads(cfg.train.threads)
    ds = load_dataset(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    check_task(cfg, ds)
    part, path, cached = build_or_load(ds, cfg, partitions_root, build)
    check_population(cfg, part.num_clients)
    data = build_client_data(ds, part).to(resolve_device(cfg.train.device, cfg.train.fast_math))
    model = build_model(cfg.model.name, data.input_shape, data.num_outputs, cfg.model.hidden).to(data.train.x.device)
    model.eval()  # evaluation mode by default (BN uses its statistics); the trainers switch to training mode
    model.conv_layout = cfg.train.conv_layout  # train.conv_layout, read by the stacked path (engine.functional.conv_layout)
    truth = {"theta": ds.meta["theta"]} if "theta" in ds.meta else {}
    return assemble(cfg, model, data, truth, partition_path=path, partition_hash=part.content_hash, partition_cached=cached,
                    threads=threads, info={"heterogeneity": dict(part.info.get("heterogeneity") or {})},
                    readers=readers, inputs=inputs)


def assemble(cfg: ExperimentConfig, model: torch.nn.Module, data: ClientData, truth: Optional[dict] = None, *,
             partition_path: Optional[Path] = None, partition_hash: str = "", partition_cached: bool = False,
             threads: int = 1, info: Optional[dict] = None, readers: Optional[dict[str, Reader]] = None,
             inputs: bool = True) -> PreparedRun:
    """The run over prepared data and model: the algorithm, the active stages, the files they
    name (read here, :mod:`flockfl.inputs`) and the context their hooks see."""
    algorithm, stages = build_algorithm(cfg), build_stages(cfg, model)
    files = read_inputs(algorithm, stages.values(), model, readers or {}) if inputs else {}
    ctx = RunContext(cfg, model, data, truth or {}, inputs=files)
    return PreparedRun(cfg, ctx, algorithm, partition_path, partition_hash, partition_cached, threads, info or {},
                       stages=stages)


def prepare_data(cfg: ExperimentConfig, data: ClientData, model: Optional[torch.nn.Module] = None) -> PreparedRun:
    """A run on client data built elsewhere (a synthetic problem such as
    ``flockfl.data.lsq.hetero_lsq``, a test's clients): no dataset, no partition store."""
    model = model or build_model(cfg.model.name, data.input_shape, data.num_outputs, cfg.model.hidden)
    model.conv_layout = cfg.train.conv_layout
    return assemble(cfg, model, data)


def check_task(cfg: ExperimentConfig, ds) -> None:
    """The data decides regression or classification (float labels are regression); the
    model must fit it, and the cohort must fit the population."""
    if ds.task == "regression" and cfg.model.name != "linear":
        raise ConfigError(f"model.name: {cfg.model.name!r} is a classifier; dataset {cfg.dataset.name!r} has float labels "
                          "(a regression task); use model.name=linear")
    if ds.task == "classification" and cfg.model.name == "linear":
        raise ConfigError(f"model.name: 'linear' is a regression model; dataset {cfg.dataset.name!r} has class labels, "
                          f"so it needs a classifier ({classifier_list()})")
    check_protocol(cfg, ds.task)


def check_population(cfg: ExperimentConfig, num_clients: int) -> None:
    """The cohort must fit the clients that federate (all but the newcomers)."""
    seen = num_clients - len(unseen_clients(num_clients, cfg.partition.unseen_fraction, cfg.seed))
    if cfg.train.clients_per_round > seen:
        raise ConfigError(f"train.clients_per_round: {cfg.train.clients_per_round} exceeds the {seen} clients that federate "
                          f"({num_clients} clients, unseen_fraction={cfg.partition.unseen_fraction}); lower it")
