"""The sections of how a run is measured, recorded and executed: ``eval`` (the accuracy
conventions), ``tracking`` (MLflow) and ``executor`` (in this process or on a Dask cluster).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from flockfl.config.section import _Section


class EvalConfig(_Section):
    """How accuracy is measured and reported (the papers differ; ``flockfl/eval_protocol.py``).

    ``test_set``: each client's test samples: ``proportional`` (a disjoint slice of the test
    set in its training class proportions) or ``label_union`` (every test sample of every
    label the client holds: the PACFL, FLIS and Sub-FedAvg code and the thesis).
    ``average``: the mean over clients weighted by test ``samples`` or unweighted over ``clients``.
    ``report``: which evaluated round ``metrics.accuracy`` is: the ``final`` one, the ``best``
    (NIID-Bench, PFLlib), the best once every client has trained at least once
    (``best_after_all_seen``, FlexCFL), or the ``mean_last`` ``last_k`` evaluations.
    ``conventions``: ``all`` (default) measures both test sets every evaluation, so one run
    answers every convention; ``configured`` measures ``label_union`` only when it is the
    ``test_set`` (a large population of personal models, each run on every test sample of its
    labels, pays for a convention nobody reads).
    """

    test_set: Literal["proportional", "label_union"] = Field(
        "proportional", description="each client's test samples: a disjoint slice of the test set in its training "
                                    "class proportions, or every test sample of every label it holds")
    average: Literal["samples", "clients"] = Field(
        "samples", description="the mean over clients, weighted by test samples or unweighted")
    report: Literal["final", "best", "best_after_all_seen", "mean_last"] = Field(
        "final", description="which evaluation metrics.accuracy is: the final one, the best, the best once every "
                             "client has trained, or the mean of the last last_k")
    last_k: int = Field(10, ge=1, description="report=mean_last: the number of latest evaluations averaged")
    conventions: Literal["all", "configured"] = Field(
        "all", description="all: both test sets measured every evaluation; configured: label_union only when it is "
                           "test_set")


class TrackingConfig(_Section):
    enabled: bool = Field(True, description="log the run to MLflow")
    uri: Optional[str] = Field(None, description=(  # default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd
        "the MLflow store (--tracking-uri wins); null = MLFLOW_TRACKING_URI, else sqlite:///mlflow.db at the project "
        "root (the current folder outside a project)"))
    experiment: Optional[str] = None  # MLflow experiment name; default: the experiment name
    register_model: bool = Field(True, description="register the final models in the MLflow model registry")
    plots: bool = Field(True, description="draw the run's plots and log them as artifacts")
    # how mlflow.pytorch saves the final models: pt2 (torch.export, portable, loads as a
    # GraphModule) or pickle (loads as the flockfl model class; ~3 s less per process)
    model_format: Literal["pt2", "pickle"] = Field(
        "pt2", description="how the final models are saved: pt2 (torch.export: portable, loads as a GraphModule, "
                           "inference only) or pickle (loads as the flockfl model class, which trains; spares "
                           "torch.export's seconds per process)")


class ExecutorConfig(_Section):
    """Where training shards run: in this process (local) or on a Dask cluster (dask)."""

    kind: Literal["local", "dask"] = Field("local", description="where training shards run: in this process "
                                                               "(local) or on a Dask cluster (dask)")
    address: Optional[str] = None  # an existing Dask scheduler (tcp://host:8786); None = start a LocalCluster
    workers: int = Field(2, ge=1)  # LocalCluster workers (processes)
    threads_per_worker: int = Field(1, ge=1, description="threads of each LocalCluster worker")
    # where workers read partitions by content hash; None = the flow's partitions directory
    data_root: Optional[str] = None
    connect_timeout_s: float = Field(10.0, gt=0)  # reaching the scheduler at executor.address
    # GPU workers (started with --resources GPU=1): the share of a GPU's free memory one shard may
    # use; a shard that would need more is trained in pieces on the worker
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1)

    @field_validator("address")
    @classmethod
    def _address_needs_dask(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v and info.data.get("kind") != "dask":
            raise ValueError("a Dask scheduler address needs executor.kind=dask; set it or remove executor.address")
        return v
