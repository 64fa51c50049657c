"""Typed experiment configuration, validated once at the boundary.

An experiment is a nested mapping (``seed``, ``dataset``, ``partition``, ``model``,
``algorithm``, ``train``, ``tracking``, the stages, ``executor``). This module is its typed
schema and nothing else: loading (``params.yaml``, YAML files, ``--set``) and the checks
that need the registries (the algorithm's own keys) are in ``flockfl.experiments``. A
problem raises :class:`ConfigError`, whose message is one line naming the key, the value
and the fix.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, get_args

from flockfl.errors import ConfigError, did_you_mean
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from flockfl import plugins



class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _or_plugin(kind: str, section: type[BaseModel], value: Any, handler: Any, field: str) -> Any:
    """A name the field's Literal spells out (flockfl's built-ins), or one a plugin registered
    (``flockfl.plugins``: entry points, ``FLOCKFL_PLUGINS``), loaded at the first name that is
    not a built-in. An unknown name is the Literal's error, the plugins' names listed too."""
    try:
        return handler(value)
    except ValidationError as err:
        if not isinstance(value, str) or err.errors()[0]["type"] != "literal_error":
            raise
        extra = plugins.names(kind)
        if value in extra:
            return value
        known = [repr(n) for n in (*get_args(section.model_fields[field].annotation), *extra)]
        raise PydanticCustomError("literal_error", "Input should be {expected} (a plugin's name needs its plugin: "
                                  f"{plugins.ENV}=module or an installed package, docs/plugins.md)",
                                  {"expected": ", ".join(known[:-1]) + " or " + known[-1]}) from None


class DatasetConfig(_Section):
    name: Literal["digits", "fashion_mnist", "mnist", "npz", "synthetic_linreg", "mix", "synthetic_fedprox"] = Field(
        "digits", description="the dataset (docs/data.md): digits (bundled, offline), fashion_mnist / mnist (IDX "
                              "files), npz (your own arrays), synthetic_linreg, synthetic_fedprox or mix")
    path: Optional[str] = Field(None, description=(  # npz file, or a directory holding IDX files
        "npz: the .npz file (required); fashion_mnist / mnist: the folder searched first for the IDX files; "
        "mix: the folder holding one <source>/ folder per IDX source; a relative path is read from the project root"))
    # mix: every source is one ground-truth group with its own 10 labels (offset 10 per source);
    # None = fashion_mnist and digits (brought to 28×28), plus mnist when its files are present
    sources: Optional[list[Literal["fashion_mnist", "mnist", "digits"]]] = None
    test_fraction: float = Field(0.2, gt=0, lt=1)  # digits only: held-out share of the bundled set
    # synthetic_linreg (IFCA mixture of linear regressions, spec §4.1)
    clusters: int = Field(2, ge=1, description="synthetic_linreg: the number k of ground-truth linear models θ*_j "
                                               "(clients in contiguous equal blocks)")
    dim: int = Field(20, ge=1, description="synthetic_linreg: the feature dimension d")
    samples_per_client: int = Field(100, ge=1, description="synthetic_linreg: training samples per client")
    test_samples_per_client: int = Field(100, ge=1, description="synthetic_linreg: test samples per client")
    noise: float = Field(0.1, ge=0, description="synthetic_linreg: the label noise σ in y = ⟨x, θ*⟩ + σ·ε")
    separation: float = Field(1.0, gt=0, description="synthetic_linreg: the scale R of the models, θ*_j = R·b_j with "
                                                     "b_j ~ Bernoulli(0.5)^d")
    # synthetic_fedprox (FedProx's Synthetic(α, β), flexcfl.md §7): per-device models W_k ~ N(u_k, 1),
    # u_k ~ N(0, α); features x ~ N(v_k, Σ), v_k ~ N(B_k, 1), B_k ~ N(0, β); natural clients
    syn_alpha: float = Field(1.0, ge=0, description="synthetic_fedprox: α, how far the devices' models differ "
                                                    "(u_k ~ N(0, α); W_k, b_k ~ N(u_k, 1))")
    syn_beta: float = Field(1.0, ge=0, description="synthetic_fedprox: β, how far the devices' features differ "
                                                   "(B_k ~ N(0, β); v_k ~ N(B_k, 1); x ~ N(v_k, Σ))")
    # input standardisation, applied where the data is loaded (every split, every client): none (NIID-Bench and
    # IFCA feed MNIST/Fashion-MNIST pixels in [0, 1]) or per_channel, x ← (x − mean_c)/std_c over the image
    # channels, with the training set's own per-channel statistics, or normalize_mean / normalize_std when given
    # (the thesis's code uses MNIST's (0.1307,), (0.3081,) for Fashion-MNIST too)
    normalize: Literal["none", "per_channel"] = Field(
        "none", description="input standardisation as the data loads: none (images as loaded, pixels in [0, 1]) or "
                            "per_channel, x ← (x − mean_c)/std_c with the training set's statistics or the two keys below")
    normalize_mean: Optional[list[float]] = Field(
        None, description="per_channel: each image channel's mean (e.g. [0.1307]); null = the training set's own")
    normalize_std: Optional[list[float]] = Field(
        None, description="per_channel: each image channel's standard deviation (e.g. [0.3081]); null = the training "
                          "set's own")

    @field_validator("name", mode="wrap")
    @classmethod
    def _plugin_dataset(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        return _or_plugin("dataset", cls, value, handler, info.field_name)


# generator choices and the schemes they shape: ``partition_key`` records each (defaults resolved) for those
# schemes only, so a partition built under another choice or an earlier default is never reused, and the
# content address of every other scheme's partition stays as it was
# (None: every scheme; the test split's keys are recorded only with test_split=local: PartitionConfig.generator)
GENERATOR_KEYS: dict[str, Optional[tuple[str, ...]]] = {
    "dirichlet_rule": ("dirichlet", "sc_dir"), "min_size": ("dirichlet", "sc_dir"),
    "rotated_mode": ("rotated",), "shard_size": ("shards", "sc_niid"),
    "test_split": None, "local_test_fraction": None,
}
DIRICHLET_MIN_SIZE = {"niid_bench": 10, "flockfl": 2}  # min_size unset: each rule's own
# models whose architecture changed under the same name (lenet5: Table 3.17's unpadded first conv; the padded one
# is lenet5_padded): a partition built with one as the difficulty expert records the revision in its address
MODEL_REVISIONS = {"lenet5": "table_3_17"}


class PartitionConfig(_Section):
    name: Optional[str] = None  # a partition named in params.yaml: its settings are inherited
    scheme: Literal["iid", "dirichlet", "shards", "shards_pct", "rotated", "label_swap", "natural",
                    "sc_niid", "sc_dir", "mix", "pfllib_pat"] = Field(
        "iid", description="how the data is split among the clients (the scheme table of docs/data.md)")
    # None: 10, or with scheme=natural as many clients as the data holds
    num_clients: Optional[int] = Field(None, ge=1, description="the number of clients; null = 10, or with "
                                                               "scheme=natural as many clients as the data holds")
    alpha: float = Field(0.5, gt=0, description="dirichlet, sc_dir: the concentration α of Dir(α) (smaller: more "
                                                "label skew)")
    k: int = Field(4, ge=1, description="rotated, label_swap: the number of ground-truth groups")
    classes_per_client: int = Field(2, ge=1, description="shards, sc_niid: label-sorted shards per client; "
                                                         "pfllib_pat: classes per client (s)")
    label_swap_mode: Literal["pairs", "random_perm"] = Field(
        "pairs", description="label_swap: group j > 0 swaps labels 2(j−1) and 2(j−1)+1 (mod C), or has a random "
                             "label permutation; group 0 keeps the labels")
    # C-NIID(ρ%) / SC-NIID(ρ%): the share of labels (in percent) each client holds (thesis §3.3)
    rho: Optional[float] = Field(None, gt=0, le=100, description=(
        "shards_pct, sc_niid: C-NIID(ρ%), the share of the labels (percent) each client holds (thesis §3.3); "
        "null = 20 with shards_pct, shards with sc_niid"))
    # super clusters of classes (SC-NIID / SC-Dir, thesis §5.2.1): class-subspace signatures with
    # sc_p left singular vectors, Eq. 5.1 angles, hierarchical clustering into sc_clusters groups
    # (or cut at sc_threshold degrees when that is set)
    sc_p: int = Field(3, ge=1, description="sc_niid, sc_dir: left singular vectors per class, the class-subspace "
                                           "signatures of the super clusters (thesis §5.2.1)")
    sc_clusters: int = Field(2, ge=1, description="sc_niid, sc_dir: the number of super clusters of classes")
    sc_threshold: Optional[float] = Field(None, gt=0, description="sc_niid, sc_dir: cut the clustering at this "
                                                                  "angle (degrees) instead; null = sc_clusters groups")
    sc_linkage: Literal["weighted", "average", "complete", "single"] = Field(
        "weighted", description="sc_niid, sc_dir: the linkage of the hierarchical clustering of the classes")
    # iid, rotated, label_swap: equal training sets, or DIFCA's uneven sizes (randint(1, 2N/m) rescaled)
    client_sizes: Literal["equal", "uneven"] = "equal"
    # samples per client: mix (default: as many as fit evenly), rotated with rotated_mode=ifca (IFCA's n; default:
    # the whole training set over the group's clients)
    samples_per_client: Optional[int] = Field(None, ge=1)
    # dirichlet, sc_dir: niid_bench (NIID-Bench's code, which the thesis reuses: per class p ~ Dir(α) over the
    # clients, p_j zeroed for a client already holding N/n samples or more, renormalised; the whole split redrawn
    # until every client holds min_size) or flockfl (the rule before: no balancing, min_size 2)
    dirichlet_rule: Literal["niid_bench", "flockfl"] = "niid_bench"
    min_size: Optional[int] = Field(None, ge=1)  # dirichlet, sc_dir: samples every client needs; None = the rule's (10, 2)
    # rotated: ifca (IFCA's code: every group gets the whole training set, permuted afresh, as its m_j clients × n
    # samples, and the whole test set) or disjoint (the rule before: one split of the data over all clients)
    rotated_mode: Literal["ifca", "disjoint"] = "ifca"
    # shards, sc_niid: samples per shard (Sub-FedAvg: 250; 125 for CIFAR-100), the n·s shards cut from a random
    # n·s·shard_size samples; None = the data cut into exactly n·s shards (McMahan et al.: 300 on MNIST)
    shard_size: Optional[int] = Field(None, ge=1)
    # each client's test samples: global (a slice of the dataset's test set in the client's training class
    # proportions) or local (PFLlib: the dataset's train and test sets merged into one pool before the scheme
    # partitions it, and each client's own samples split at random, local_test_fraction of them to its test set)
    test_split: Literal["global", "local"] = "global"
    local_test_fraction: float = Field(  # test_split=local: PFLlib's 1 − train_ratio (0.75)
        0.25, gt=0, lt=1, description="test_split=local: the share of each client's own samples that goes to its "
                                      "test set (PFLlib's 1 − train_ratio)")
    # clients that never train and join after federation (newcomers); drawn from (seed, "unseen")
    unseen_fraction: float = Field(0.0, ge=0, lt=1)
    # training samples (stratified) withheld from every client as the server's own data (FLIS);
    # None = what the algorithm needs (algorithm.server_data_size), else 0
    server_holdout: Optional[int] = Field(None, ge=0)
    # Algorithm 2 of the curriculum chapter (flockfl/data/difficulty.py): after the scheme, each
    # client keeps its class counts, and f_ord of each count is a contiguous block of samples
    # ranked by an expert's loss (the rest random); None = off
    difficulty_fraction: Optional[float] = Field(None, ge=0, le=1)
    difficulty_model: Literal["mclr", "mlp", "lenet5", "lenet5_padded", "lenet5_bn", "cnn_bn",
                              "pfllib_cnn", "pfl_cnn"] = Field(  # the expert θ_E
        "mclr", description="difficulty_fraction: the expert θ_E, a model trained centrally whose loss ranks the samples")
    difficulty_epochs: int = Field(10, ge=1, description="difficulty_fraction: the expert's central training epochs")

    def resolved_min_size(self) -> int:
        """``min_size``, or the Dirichlet rule's own when unset (NIID-Bench 10, flockfl 2)."""
        return DIRICHLET_MIN_SIZE[self.dirichlet_rule] if self.min_size is None else self.min_size

    def generator(self) -> dict[str, Any]:
        """The generator choices that shape this scheme's partition, defaults resolved (the
        partition's content address and JSON summary record them)."""
        out = {k: getattr(self, k) for k, schemes in GENERATOR_KEYS.items() if schemes is None or self.scheme in schemes}
        if "min_size" in out:
            out["min_size"] = self.resolved_min_size()
        if self.test_split == "global":  # the default: the addresses of every partition before it stay as they were
            out.pop("test_split")
            out.pop("local_test_fraction")
        return out

    @field_validator("scheme", "difficulty_model", mode="wrap")
    @classmethod
    def _plugin_scheme(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        kind = "scheme" if info.field_name == "scheme" else "model"
        return _or_plugin(kind, cls, value, handler, info.field_name)


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
    # clients per chunk when evaluating or fine-tuning every client (bounds memory at scale)
    eval_chunk: int = Field(1024, ge=1)
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


class ShiftConfig(_Section):
    """Client-level distribution shift (FlexCFL §3, ``flockfl/stages/shift.py``): applied each round
    after client selection and before any clustering step; the union of the clients' data never
    changes. Deterministic given (seed, round), and part of the state."""

    kind: Literal["none", "swap_all", "swap_part", "incremental"] = Field(
        "none", description="none; swap_all (paired clients swap all their data), swap_part (each of a pair gives the "
                            "other a label it lacks) or incremental (each client's data released step by step)")
    probability: float = Field(0.05, ge=0, le=1)  # swap_*: each pair of clients swaps with this probability
    start_round: int = Field(0, ge=0)  # the first round (0-based) a shift may happen
    # incremental: each client's training data is released step by step: `release` more of it
    # every `every` rounds from start_round (0.25, 50: 1/4, 1/2, 3/4, all at rounds 0, 50, 100, 150)
    release: float = Field(0.25, gt=0, le=1)
    every: int = Field(50, ge=1, description="incremental: rounds between two releases")
    # paper_intent, or code_faithful: the official code's quirks (incremental sizes computed from the
    # current size, so released data shrinks; swap_part stops the round at a pair with no exclusive label)
    mode: Literal["paper_intent", "code_faithful"] = "paper_intent"


class CurriculumConfig(_Section):
    """Data and client curricula (thesis Chapter 2, ``flockfl/stages/curriculum.py``), for any
    algorithm. Off by default (``ordering=vanilla`` and ``clients=false``)."""

    ordering: Literal["vanilla", "curr", "anti", "random"] = Field(
        "vanilla", description="order of each client's samples: vanilla (off), curr (easy first), anti (hard first), random")
    scoring: Literal["s_G", "s_L", "s_LG", "s_G_pred", "s_L_pred", "s_LG_pred", "s_E"] = Field(
        "s_G", description="difficulty score (§1.3): loss under the received model (s_G), the client's last local "
                           "model (s_L), both (s_LG), the prediction checks (*_pred), or the expert (s_E)")
    pacing: Literal["linear", "exp", "step", "root", "quad"] = Field("linear", description="pacing family g(t) (Table 2.1)")
    a: float = Field(0.8, ge=0, le=1, description="share of the local budget after which all samples are used")
    b: float = Field(0.2, ge=0, le=1, description="share of the samples exposed at the first step")
    pacing_literal: bool = Field(False, description="the printed (N − b) growth of the root/linear/quad rows instead of N(1 − b)")
    pacing_scope: Literal["round", "global"] = Field(
        "round", description="the pacing clock: each round's local steps (Algorithm 1) or the whole run's")
    clients: bool = Field(False, description="client curriculum (§1.5): the cohort comes from a paced pool of ranked clients")
    client_ordering: Optional[Literal["curr", "anti", "random"]] = Field(
        None, description="order of the clients (null: the data ordering, or curr when that is vanilla)")
    client_scoring: Literal["s_G", "s_E"] = Field("s_G", description="client score 1/L_k under the global (s_G) or expert (s_E) model")
    expert: str = Field("global", description="the expert model of s_E: global (the current server model, so s_E = s_G), "
                                              "an MLflow model URI (models:/NAME/VERSION, runs:/ID/model_0) or a .pt file")
    local_model: Literal["persisted", "received"] = Field(
        "persisted", description="s_L's local model: the client's model from its last participation (the received one "
                                 "until it has one), or always the received one")


class PruningConfig(_Section):
    """Sub-FedAvg pruning (thesis Chapter 4, ``flockfl/stages/subfedavg.py``), for any algorithm.
    Off by default (``method=none``)."""

    method: Literal["none", "unstructured", "structured", "hybrid"] = Field(
        "none", description="none, unstructured (Algorithm 10), structured (BN channels) or hybrid (Algorithm 11)")
    target: float = Field(0.5, gt=0, lt=1, description="share of prunable weights to reach (p_us; hybrid: of the FC weights)")
    rate: float = Field(0.1, gt=0, le=1, description="share of the still-alive weights pruned per prune event (r_us)")
    mask_threshold: Optional[float] = Field(
        None, ge=0, description="ε_us, the first/last-epoch mask distance below which a client stops pruning "
                                "(null: 1e-4 unstructured, 0.05 hybrid, the seed's values)")
    channel_target: float = Field(0.5, gt=0, lt=1, description="share of BN channels to prune (p_s; structured, hybrid)")
    channel_rate: float = Field(0.1, gt=0, le=1, description="share of a layer's alive channels pruned per event (r_s)")
    channel_threshold: float = Field(0.05, ge=0, description="ε_s, the channel-mask distance threshold")
    acc_threshold: float = Field(0.5, ge=0, le=1, description="Acc_th: a client prunes only while its accuracy is at least this")
    acc_gate: Literal["after_mask", "before_training"] = Field(
        "after_mask", description="when the accuracy gate is measured: on the masked model after training (the "
                                  "authors' code) or on the received model before training (Algorithm 10)")


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
        # plugin dataset's) labels decide it when the data is loaded (flockfl.rounds.check_task)
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


# ---------------------------------------------------------------------- parsing


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


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
