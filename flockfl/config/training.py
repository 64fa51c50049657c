"""The sections of what trains and how: ``model`` (the network, and which models are
classifiers), ``algorithm`` (the method's name; its own keys are declared beside its maths),
``train`` (rounds, local training, the trainer and the device) and ``system`` (the simulated
clients' speeds).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flockfl import plugins
from flockfl.config.section import _or_plugin, _Section


class ModelConfig(_Section):
    # lenet5: thesis Table 3.17 (valid 5×5 convs: 256 FC inputs on 28×28, NIID-Bench's CNN too); lenet5_padded:
    # padding 2 on the first conv (400 FC inputs on 28×28, LeCun's 32×32 geometry); pfllib_cnn: PFLlib's 4-layer
    # CNN (FedAvgCNN: conv 32, conv 64, FC 512, out; 582,026 parameters on 28×28); pfl_cnn: pfl-research's
    # simple_cnn without dropout (conv 32, conv 64, pool, FC 128, out; benchmarks/pfl_compare.py)
    name: Literal["mclr", "mlp", "lenet5", "lenet5_padded", "linear", "lenet5_bn", "cnn_bn", "pfllib_cnn",
                  "pfl_cnn"] = Field("mlp", description="the network (the models table of docs/config.md); "
                                                        "linear is for regression only")
    hidden: int = Field(200, ge=1, description="mlp: hidden units (IFCA's MNIST model is 784-200-10); the other "
                                               "models ignore it")

    @field_validator("name", mode="wrap")
    @classmethod
    def _plugin_model(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        return _or_plugin("model", cls, value, handler, info.field_name)


REGRESSION_MODELS = ("linear",)


def classifier_list() -> str:
    """The classifier models of ``model.name`` (every model but the regression ones), for messages."""
    names = [m for m in (*get_args(ModelConfig.model_fields["name"].annotation), *plugins.names("model"))
             if m not in REGRESSION_MODELS]
    return ", ".join(names[:-1]) + " or " + names[-1]


class AlgorithmConfig(BaseModel):
    """``algorithm.name`` plus that algorithm's own hyper-parameters.

    The keys are not listed here: each algorithm declares its own (name, default, range,
    meaning, symbol) beside its maths (``flockfl/algorithms/*.py``, see ``hyper.py``). They are
    checked, and their defaults filled in, when the experiment config is validated.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = "fedavg"

    def hyper(self) -> dict[str, Any]:
        """The hyper-parameters (every key but ``name``)."""
        return dict(self.__pydantic_extra__ or {})


class TrainConfig(_Section):
    rounds: int = Field(30, ge=1, description="communication rounds")
    clients_per_round: int = Field(10, ge=1, description="clients selected each round (the cohort); at most "
                                                         "partition.num_clients")
    local_epochs: int = Field(1, ge=1, description="local epochs E of every selected client per round")
    local_steps: Optional[int] = Field(None, ge=1)  # fixed number of local steps (overrides epochs)
    batch_size: int = Field(10, ge=1, description="local mini-batch size (0 is not allowed; use full_batch)")
    full_batch: bool = Field(False, description="every local step uses the client's whole training set (one step "
                                                "per epoch: gradient descent)")
    lr: float = Field(0.05, gt=0, description="the local SGD learning rate η₀")
    # local heavy-ball momentum ρ (buf ← ρ·buf + g, reset every round unless optimizer_state=persist) for every local
    # training (the thesis's curriculum runs use 0.9, Sub-FedAvg 0.5); FedNova has its own algorithm.momentum
    momentum: float = Field(0.0, ge=0, lt=1)
    # the local optimiser's state (the momentum buffer) between a client's rounds: reset (a fresh optimiser every
    # round, the papers') or persist (each client's buffer kept in the server state and resumed where its last round
    # left it, as codes that keep one optimiser per client do, e.g. CFL's notebook); needs train.momentum
    optimizer_state: Literal["reset", "persist"] = "reset"
    # L2 weight decay ω, added to every local gradient before momentum as torch.optim.SGD's weight_decay does
    # (g + ω·w; NIID-Bench 1e-5, the curriculum thesis 5e-4)
    weight_decay: float = Field(0.0, ge=0)
    # the local learning rate of step i (counted from 0 within the round's local training) in round r: constant
    # (train.lr), inverse η₀(1 + α·i)^−b (the curriculum thesis §2.8, reset every round; Caffe's "inv"), or step
    # η₀·γ^⌊r/lr_step_rounds⌋ (CFL's code: ×0.99 per round); η₀ = train.lr
    lr_schedule: Literal["constant", "inverse", "step"] = "constant"
    lr_alpha: float = Field(0.001, ge=0)  # inverse: α (the thesis: 0.001)
    lr_b: float = Field(0.75, ge=0)  # inverse: b (the thesis: 0.75)
    lr_gamma: float = Field(0.99, gt=0, le=1)  # step: the factor γ per decay
    lr_step_rounds: int = Field(1, ge=1)  # step: rounds between decays
    engine: Literal["auto", "vectorized", "reference"] = Field(
        "auto", description="the trainer (docs/engine.md): vectorized (the cohort at once), reference (a per-client "
                            "loop) or auto (the first cohort timed on both, the faster kept)")
    shard_size: int = Field(256, ge=1)  # clients per vectorised training task
    parallel_shards: int = Field(1, ge=1)  # training tasks run at once (threads; 1 suits a small CPU)
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="where training runs: cpu, cuda, or auto "
                                                                     "(CUDA when available)")
    # on CUDA: false (default) = deterministic kernels, TF32 off, so a resume on a GPU is
    # bit-identical; true = TF32 and non-deterministic kernels (faster, gives up bit-identity)
    fast_math: bool = False
    # the memory format of the convolutions of the vectorised trainer and of its precise BN: auto
    # (channels-last on a CPU, where oneDNN's kernels measured faster, docs/benchmarks.md; contiguous NCHW on a
    # GPU), channels_last, or contiguous (NCHW: the vectorised trainer's bits are vmap's); the layouts agree to
    # float rounding
    conv_layout: Literal["auto", "channels_last", "contiguous"] = "auto"
    # clients per chunk when evaluating or fine-tuning every client (bounds memory at scale)
    eval_chunk: int = Field(256, ge=1)
    # the end-of-run fine-tuned evaluation holds at most this many MB of fine-tuned models at once
    # (fewer clients a chunk than eval_chunk for large models; the numbers do not change)
    finetune_chunk_mb: float = Field(32.0, gt=0)
    threads: int = Field(0, ge=0)  # torch intra-op threads; 0 = number of cores (max 4)
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds, and always after the last")
    max_retries: int = Field(1, ge=0)  # per training shard, before its clients are dropped
    # local epochs of the "after local training" evaluation convention (accuracy_finetuned, the
    # thesis's metric) and of newcomers' fine-tuning; None = local_epochs
    finetune_epochs: Optional[int] = Field(None, ge=0)
    # when accuracy_finetuned is computed: at the last round (final), at every evaluation, or never
    eval_finetune: Literal["final", "every", "off"] = "final"
    checkpoints_to_keep: int = Field(3, ge=2, description="checkpoints kept in the run directory (the newest; "
                                                          "older ones are pruned)")
    # per-client local work: constant (every client E epochs) or uniform_random (E_i drawn from
    # 1..E per client and round, from the (seed, round, client, "local_work") stream)
    local_work: Literal["constant", "uniform_random"] = "constant"
    target_accuracy: Optional[float] = Field(None, gt=0, le=1)  # report rounds and sim_time to reach it
    simulate_failures: list[int] = []  # client ids whose local training raises (fault-injection drills)


class SystemConfig(_Section):
    """Simulated client speeds (see flockfl/system.py): lognormal around the medians, or per client."""

    compute_median: float = Field(20.0, gt=0, description="the clients' median compute speed CP_i, batches per "
                                                          "second (lognormal around it)")
    compute_sigma: float = Field(0.5, ge=0)  # lognormal spread (0 = identical clients)
    batch_overhead: float = Field(0.0, ge=0)  # seconds per batch (FedEff's γ_i)
    bandwidth_median: float = Field(5.0, gt=0, description="the clients' median bandwidth, MB/s, both directions")
    bandwidth_sigma: float = Field(0.5, ge=0, description="lognormal spread of the bandwidths (0 = identical clients)")
    client_compute: Optional[list[float]] = Field(  # per-client overrides (one value per client)
        None, description="per-client compute speeds (batches/s), one value per client, instead of the draw")
    client_down: Optional[list[float]] = Field(
        None, description="per-client download bandwidths (MB/s), one value per client, instead of the draw")
    client_up: Optional[list[float]] = Field(
        None, description="per-client upload bandwidths (MB/s), one value per client, instead of the draw")
