"""The data sections: ``dataset`` (which data, where it is read from, its standardisation) and
``partition`` (how it is split among the clients), with the generator choices and model
revisions that a partition's content address records.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from flockfl.config.section import _or_plugin, _Section


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
