"""The whole experiment config: :class:`ExperimentConfig` (every section, the rules between
sections that need no registry, the settings that address a partition and the config's
identity) and :func:`validate_schema`, the schema's check, whose failure is a one-line
:class:`~flockfl.errors.ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, Field, ValidationError, model_validator

from flockfl.config.data import GENERATOR_KEYS, MODEL_REVISIONS, DatasetConfig, PartitionConfig
from flockfl.config.mappings import flatten
from flockfl.config.run import EvalConfig, ExecutorConfig, TrackingConfig
from flockfl.config.section import _Section
from flockfl.config.stages import CurriculumConfig, PruningConfig, ShiftConfig
from flockfl.config.training import AlgorithmConfig, ModelConfig, SystemConfig, TrainConfig, classifier_list
from flockfl.errors import ConfigError, did_you_mean


class ExperimentConfig(_Section):
    name: str = Field("experiment", description="the experiment's name: the MLflow experiment and the default "
                                                "run directory runs/<name>-<time>")
    seed: int = Field(0, ge=0, description="the seed every random stream derives from (data, partition, models, "
                                           "selection, batches)")
    dataset: DatasetConfig = DatasetConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    eval: EvalConfig = EvalConfig()
    system: SystemConfig = SystemConfig()
    shift: ShiftConfig = ShiftConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    pruning: PruningConfig = PruningConfig()
    executor: ExecutorConfig = ExecutorConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "ExperimentConfig":
        """Rules between sections that need no registry (``flockfl.experiments.validate`` adds
        those that do: the algorithm's own keys, the dataset's schemes)."""
        part = self.partition
        if part.num_clients is None and part.scheme != "natural":
            part.num_clients = 10
        n = part.num_clients
        for key in ("client_compute", "client_down", "client_up"):
            given = getattr(self.system, key)
            if given is not None and ((n is not None and len(given) != n) or min(given) <= 0):
                raise ValueError(f"system.{key}: needs {n} positive values, one per client")
        # regression or classification: known here for the built-in datasets; an npz file's (and a
        # plugin dataset's) labels decide it when the data is loaded (flockfl.preparation.check_task)
        if self.dataset.name == "synthetic_linreg" and self.model.name != "linear":
            raise ValueError(f"model.name: {self.model.name!r} cannot fit synthetic_linreg; use model.name=linear")
        builtin = get_args(DatasetConfig.model_fields["name"].annotation)
        if self.dataset.name in builtin and self.dataset.name not in ("synthetic_linreg", "npz") and self.model.name == "linear":
            raise ValueError(f"model.name: 'linear' is a regression model; dataset {self.dataset.name!r} needs a classifier ({classifier_list()})")
        if self.dataset.name == "npz" and not self.dataset.path:
            raise ValueError("dataset.path: the npz dataset needs a file; set dataset.path=/path/to/data.npz")
        ds = self.dataset
        if ds.normalize == "none" and (ds.normalize_mean is not None or ds.normalize_std is not None):
            raise ValueError("dataset.normalize_mean / normalize_std: given with dataset.normalize=none; set "
                             "dataset.normalize=per_channel or remove them")
        if (ds.normalize_mean is None) != (ds.normalize_std is None) or (
                ds.normalize_mean is not None and len(ds.normalize_mean) != len(ds.normalize_std)):
            raise ValueError("dataset.normalize_mean / normalize_std: give both, one value per image channel each "
                             "(e.g. [0.1307] and [0.3081]), or neither (the training set's own statistics)")
        if ds.normalize_std is not None and min(ds.normalize_std) <= 0:
            raise ValueError(f"dataset.normalize_std: every standard deviation must be > 0 (got {ds.normalize_std})")
        if ds.normalize != "none" and ds.name in ("synthetic_linreg", "synthetic_fedprox"):
            raise ValueError(f"dataset.normalize: {ds.normalize!r} standardises image channels; {ds.name} has feature "
                             "vectors; use dataset.normalize=none")
        if self.train.momentum and self.algorithm.name == "fednova":
            raise ValueError("train.momentum: FedNova normalises by its own local momentum; set algorithm.momentum instead")
        if self.pruning.method in ("structured", "hybrid") and self.model.name not in ("lenet5_bn", "cnn_bn"):
            raise ValueError(f"pruning.method: {self.pruning.method!r} prunes BatchNorm channels; model.name="
                             f"{self.model.name!r} has none; use model.name=lenet5_bn or cnn_bn")
        if self.curriculum.ordering != "vanilla" and self.train.full_batch:
            raise ValueError("curriculum.ordering: a data curriculum paces mini-batches; train.full_batch=true has none")
        expert = self.curriculum.expert
        if expert != "global" and not expert.startswith(("models:/", "runs:/")) and not Path(expert).is_file():
            raise ValueError(f"curriculum.expert: no file {expert!r}; give a .pt file, an MLflow model URI "
                             "(models:/NAME/VERSION) or global")
        if self.pruning.method != "none" and self.model.name == "linear":
            raise ValueError("pruning.method: Sub-FedAvg prunes classifiers; model.name=linear is a regression model")
        if n is not None and self.train.clients_per_round > n:
            raise ValueError(
                f"train.clients_per_round: {self.train.clients_per_round} exceeds partition.num_clients="
                f"{self.partition.num_clients}; lower it or add clients"
            )
        if part.client_sizes == "uneven" and part.scheme not in ("iid", "rotated", "label_swap"):
            raise ValueError(f"partition.client_sizes: 'uneven' applies to the iid, rotated and label_swap schemes, not "
                             f"{part.scheme!r}; remove it or change the scheme")
        if self.partition.scheme in ("rotated", "label_swap") and self.partition.k > (n or 0):
            raise ValueError(
                f"partition.k: {self.partition.k} groups need at least as many clients (num_clients={self.partition.num_clients})"
            )
        return self

    # ------------------------------------------------------------------ helpers
    def to_flat(self) -> dict[str, Any]:
        return flatten(self.model_dump())

    def partition_key(self) -> dict[str, Any]:
        """The settings that determine the partition (used for its content address). A generator
        choice is recorded, resolved, for the schemes it shapes (``GENERATOR_KEYS``), so changing
        one (or its default) gives a new address; settings that are off are left out, so the keys
        of every earlier partition they do not touch stay as they were."""
        part = self.partition.model_dump()
        part.pop("name")
        if part["difficulty_fraction"] is None:
            for k in ("difficulty_fraction", "difficulty_model", "difficulty_epochs"):
                part.pop(k)
        elif part["difficulty_model"] in MODEL_REVISIONS:  # the expert's architecture changed under its name
            part["difficulty_model_revision"] = MODEL_REVISIONS[part["difficulty_model"]]
        for k in GENERATOR_KEYS:
            part.pop(k)
        part.update(self.partition.generator())
        dataset = self.dataset.model_dump()
        if dataset["normalize"] == "none":
            for k in ("normalize", "normalize_mean", "normalize_std"):
                dataset.pop(k)
        return {"seed": self.seed, "dataset": dataset, "partition": part}

    def digest(self) -> str:
        """The config's identity (a sweep's cells, a scheduled run's folder, the MLflow tag
        ``flockfl.config_sha256``): the settings that differ from their defaults, so a key added
        to the schema later, at a default that keeps the old behaviour, does not turn a sweep
        begun before it into "another sweep"."""
        return hashlib.sha256(json.dumps(self.model_dump(exclude_defaults=True), sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------- the schema's check


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        section = ".".join(str(p) for p in e["loc"][:-1])
        allowed = _allowed_keys(section)
        hint = did_you_mean(str(e["loc"][-1]), allowed, prefix=f"{section}." if section else "")
        return (f"config error: unknown key {loc!r}{hint}; allowed keys{' in ' + section if section else ''}: "
                f"{', '.join(allowed)}")
    if not loc:
        return f"config error: {msg}"
    hint = ""
    if e["type"] == "literal_error":  # a choice among names: suggest the closest
        hint = did_you_mean(e.get("input"), re.findall(r"'([^']*)'", str((e.get("ctx") or {}).get("expected", ""))))
    return f"config error: {loc}: {msg} (got {e.get('input')!r}){hint}"


def _allowed_keys(section: str) -> list[str]:
    model: type[BaseModel] = ExperimentConfig
    for part in filter(None, section.split(".")):
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return sorted(model.model_fields)
        model = field.annotation
    return sorted(model.model_fields)


def validate_schema(raw: dict[str, Any]) -> ExperimentConfig:
    """The schema's checks only; ``flockfl.experiments.validate`` is the whole validation."""
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None
