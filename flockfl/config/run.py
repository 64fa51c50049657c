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
    ``conventions``: which test sets are measured besides the configured ``test_set`` (always
    measured in full). ``cheap`` (default): the other one where it costs nothing more than the
    outputs already computed, that is for shared models (global, cluster), whose label-union
    sums come from one pass per model over the shared test pool; not for per-client models
    (personal models, the fine-tuned evaluation), where each client's model would run on every
    test sample of its labels (10,000 rows for an IID Fashion-MNIST client: 5x the whole
    training of a 1,200-client run). ``all``: both test sets for every model, so one run answers
    every convention (the repro tables that print several set it). ``configured``: the
    configured ``test_set`` only. ``reuse``: a client whose model and data did not change since
    its last evaluation keeps the metrics it had (``flockfl/eval_reuse.py``; bit-identical).
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
    conventions: Literal["cheap", "all", "configured"] = Field(
        "cheap", description="cheap: the configured test_set, and the other one for shared models only (no extra "
                             "forward passes); all: both test sets for every model, personal and fine-tuned ones "
                             "included; configured: the configured test_set only")
    reuse: bool = Field(
        True, description="a client whose model and data did not change since its last evaluation keeps its "
                          "metrics (bit-identical) instead of being measured again; false: measure every client "
                          "every evaluation")


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
