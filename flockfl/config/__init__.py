"""Typed experiment configuration, validated once at the boundary.

An experiment is a nested mapping (``seed``, ``dataset``, ``partition``, ``model``,
``algorithm``, ``train``, ``tracking``, the stages, ``executor``). This package is its typed
schema and nothing else: loading (``params.yaml``, YAML files, ``--set``) and the checks
that need the registries (the algorithm's own keys) are in ``flockfl.experiments``. A
problem raises :class:`~flockfl.errors.ConfigError`, whose message is one line naming the key, the value
and the fix.

This module is the package's public namespace; the schema is written in one module per job:
``section`` (the sections' base, plugin names), ``data`` (``dataset``, ``partition``),
``training`` (``model``, ``algorithm``, ``train``, ``system``), ``stages`` (``shift``,
``curriculum``, ``pruning``), ``run`` (``eval``, ``tracking``, ``executor``), ``experiment``
(:class:`ExperimentConfig` and the schema's check) and ``mappings`` (plain nested dicts).
"""

from flockfl.config.data import DIRICHLET_MIN_SIZE, GENERATOR_KEYS, MODEL_REVISIONS, DatasetConfig, PartitionConfig
from flockfl.config.experiment import ExperimentConfig, validate_schema
from flockfl.config.mappings import deep_merge, flatten
from flockfl.config.run import EvalConfig, ExecutorConfig, TrackingConfig
from flockfl.config.stages import CurriculumConfig, PruningConfig, ShiftConfig
from flockfl.config.training import (REGRESSION_MODELS, AlgorithmConfig, ModelConfig, SystemConfig, TrainConfig,
                                     classifier_list)

__all__ = ["AlgorithmConfig", "CurriculumConfig", "DIRICHLET_MIN_SIZE", "DatasetConfig", "EvalConfig",
           "ExecutorConfig", "ExperimentConfig", "GENERATOR_KEYS", "MODEL_REVISIONS", "ModelConfig", "PartitionConfig",
           "PruningConfig", "REGRESSION_MODELS", "ShiftConfig", "SystemConfig", "TrackingConfig", "TrainConfig",
           "classifier_list", "deep_merge", "flatten", "validate_schema"]
