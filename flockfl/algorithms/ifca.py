"""IFCA — Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
Learning", https://arxiv.org/abs/2006.04088 (official code: jichan3751/ifca).

k models are broadcast to every selected client. Each client picks the model with the
lowest loss on its full local training set (ties → lowest index) and trains it:

- option I (``algorithm.option=gradient``): one full-batch gradient; the server applies
  θ_j ← θ_j − (γ/m) Σ_{i∈S_t} s_ij g_i, dividing by m = *all* the m workers as in the paper
  (not |S_t|): the clients that federate, ``ctx.seen`` (newcomers, ``partition.unseen_fraction``,
  are not among the paper's m workers: they never train). A data curriculum cannot pace its
  full batch, so ``curriculum.ordering`` must stay ``vanilla``;
- option II (``algorithm.option=model``, default): τ local steps (``train.local_*``); the
  server averages the returned models per cluster (uniform by default, as in the paper;
  ``algorithm.weighting=samples`` as in the FEMNIST code). A cluster nobody chose keeps
  its model.

Weight sharing (``algorithm.shared``, spec §2.1): ``none``; ``all_but_last`` (every parameter
but those of the last layer); or a comma-separated list of parameter-name prefixes (e.g.
``1.`` for the first Linear of the MLP). Shared parameters are aggregated over *all*
participating clients (option II: the ``weighting`` mean; option I: θ ← θ − (1/m) Σ_i γ g_i),
the others per cluster as above; clients still choose their cluster with the full model.
Storage: a shared parameter stays a ``[k, ...]`` entry of ``state.models`` (so every routine
that reads stacked models works unchanged), but it is a stride-0 view of **one** tensor: kept
once in memory and once in a checkpoint (``torch.save`` keeps views). The k rows are equal
by construction. Every initialisation ties the shared parameters to one value: model 0's for
``random``/``balanced_restart``/``given``, the mean over all pre-trained clients for
``pretrain_kmeans``.

Initialisation (``algorithm.init``; in ``flockfl/algorithms/ifca_init.py``, which IFCA's hooks call):

- ``random`` (default, the paper's: "random initialisation with multiple restarts"; spec §2.1):
  k independent draws (Bernoulli(0.5)^d for the linear model, as in the synthetic code;
  PyTorch's default init otherwise). IFCA is sensitive to this start (a model may win no
  client), as the paper and the FlexCFL paper say: that sensitivity is part of the method as
  published, so the registry name keeps it;
- ``given``: a torch file of k stacked models (``algorithm.init_path``);
- ``balanced_restart``: redraw until every cluster wins ≥ ``min_cluster_frac`` of round 0's
  cohort, as in the rotated-CIFAR code;
- ``pretrain_kmeans`` [lib, after FlexCFL's group cold start, flexcfl.md §2.2; named
  "IFCA + k-means start" in tables, since it changes the method: a cohort uploads trained
  models before round 0 and the server clusters them]:
  before round 0 (the ``pre_federation`` step: checkpointed, its bytes counted),
  ``pretrain_clients`` clients train one shared start θ_0 for ``pretrain_epochs`` epochs; the
  server runs k-means++ (``n_init=10``, seeded) on an embedding of their updates
  Δ_i = θ_0 − θ_i (``pretrain_embedding``: ``layers``, each weight tensor's block of Δ_i scaled
  to unit norm, the default; ``updates``, Δ_i itself; ``edc``, FlexCFL's EDC embedding: the
  cosine similarity of Δ_i to the top-k right singular vectors of the stacked updates), and
  seeds model j with the mean (``weighting``) of cluster j's trained models. It depends on no
  lucky draw: clients of one distribution move θ_0 the same way, so their updates cluster.
  ``benchmarks/ifca_init.py``: ARI ≥ 0.95 on 5/5 seeds of rotated digits (random 3/5,
  balanced_restart 3/5) and of rotated Fashion-MNIST (2/5 and 2/5).
  [lib] ``layers`` because on rotated digits the last layer's and the biases' updates (driven by
  each client's label sample) drown the first layer's rotation signal in the raw updates: with
  one pre-training epoch, k-means on ``layers`` recovered the rotations of 16/20 seeds exactly
  (mean ARI 0.98), on ``updates`` 4/20 (0.84), on ``edc`` 0/20 (0.60). From a random θ_0 a
  concept shift (``label_swap``) hardly shows in one epoch's updates: there the start is
  little better than ``random``. With k = 1 there is nothing to cluster and no pre-training.

At evaluation each client uses the model with the lowest loss on its training data;
assignments are compared with the true groups by ARI/NMI.

``ifca_oneshot`` (the paper's Algorithm 1, spec §2.2) is in ``ifca_oneshot.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms import ifca_init
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import Hyper, choice, integer, is_auto, real, text, weighting
from flockfl.algorithms.layout import parameter_names, shared_parameters, tie
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.client import round_spec
from flockfl.context import RunContext
from flockfl.engine.functional import index_params
from flockfl.engine.schedule import LocalSpec
from flockfl.state import ServerState


class IFCA(Algorithm):
    name = "ifca"
    family = "clustered"
    one_cluster_is_fedavg = True
    paper = "Ghosh, Chung, Yin, Ramchandran, An Efficient Framework for Clustered Federated Learning, arXiv 2006.04088"

    # ------------------------------------------------------------------ the update rule (Alg. 2)
    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        """Each client takes the model of lowest loss on its training data, ĵ = argmin_j F_i(θ_j),
        and trains it: one full-batch gradient (option I) or τ local steps (option II)."""
        losses = cluster_losses(state, ctx, clients)
        chosen = assign_by_min_loss(losses)
        t = self.cfg.train
        init = index_params(state.models, torch.from_numpy(chosen))
        if self.option == "gradient":
            return LocalSpec(clients, init, t.lr, epochs=1, steps=1, full_batch=True,
                             meta={"model_of_client": chosen, "cluster_losses": losses})
        return round_spec(t, clients, init, meta={"model_of_client": chosen, "cluster_losses": losses},
                          client_epochs=self.local_work(ctx, clients, round))

    def aggregate(self, state, ctx, spec, result, assign):
        """Per cluster: the mean of the returned models (option II) or the gradient step (option I);
        a cluster nobody chose keeps its model; shared parameters over every participant."""
        if self.option == "model":
            new = super().aggregate(state, ctx, spec, result, assign)
        else:
            new = self._with_assignments(state, self.gradient_step(state, result, assign, len(ctx.seen)),
                                         result.clients, assign)
        if not self.shared:
            return new
        # shared parameters: one aggregate over every participant (cluster = "all")
        everyone = np.zeros(len(result.clients), np.int64)
        one = {k: state.models[k][:1] for k in self.shared}
        if self.option == "model":
            value = weighted_mean({k: result.params[k] for k in self.shared}, self.weights(result, np.arange(len(everyone))))
        else:
            value = {k: v[0] for k, v in self.gradient_step(state.replace(models=one), result, everyone,
                                                              len(ctx.seen), self.shared).items()}
        return new.replace(models=tie(new.models, self.shared, value))

    def gradient_step(self, state, result, assign, m, names=None) -> dict[str, torch.Tensor]:
        """Option I: θ_j ← θ_j − (1/m) Σ_{i: ĵ=j} (θ_j − θ̃_i), where θ_j − θ̃_i = γ g_i and m is
        the number of workers that federate (``len(ctx.seen)``)."""
        names = list(state.models) if names is None else names
        models = {k: state.models[k].clone() for k in names}
        for j in range(state.models[names[0]].shape[0]):
            members = torch.from_numpy(np.flatnonzero(assign == j))
            if len(members) == 0:
                continue
            for k in names:
                step = (state.models[k][j].unsqueeze(0) - result.params[k][members]).sum(0)
                models[k][j] = state.models[k][j] - step / m
        return models

    # ------------------------------------------------------------------ keys
    hyperparameters = (
        weighting("uniform", source="paper", note="Alg. 2 option II: unweighted per-cluster mean, as the MNIST/CIFAR "
                  "code; the FEMNIST code weights by n_i"),
        integer("k", 2, "number of cluster models; auto (with init=pretrain_kmeans): the k-means of the pre-training "
                "embedding with the best silhouette, one model if none clears 0.25 (flockfl.clustering.choose; 'IFCA + "
                "k-means start, auto k' in tables)", "k", ge=1, auto=True, source="thesis",
                note="the thesis's IFCA rows use C = 2 (4 on MIX-4); the paper sets k to its data's distributions: "
                     "2 on rotated CIFAR-10, 4 on rotated MNIST"),
        choice("option", "model", ("model", "gradient"), "II: average models per cluster (model); I: one gradient step "
               "(gradient)", source="paper", note="option II, as the paper's MNIST and CIFAR experiments"),
        choice("init", "random", ("random", "given", "balanced_restart", "pretrain_kmeans"),
               "how the k models start: random draws, a file, random redraws until balanced, or k-means on one "
               "pre-training pass from a shared start (pretrain_kmeans: 'IFCA + k-means start', a library option)",
               source="paper", note="random initialisation (Bernoulli(0.5)^d for the linear model, as the synthetic code)"),
        text("init_path", "init=given: a torch file of k stacked models", source="library"),
        real("min_cluster_frac", 0.1, "balanced_restart: each model must win this share of round 0's cohort", ge=0, lt=1,
             source="code", note="rotated-CIFAR code: 0.1 for k = 4, 0.35 for k = 2"),
        integer("max_tries", 10, "balanced_restart: draws before giving up", ge=1, source="library"),
        integer("pretrain_clients", None, "pretrain_kmeans: clients that pre-train (null: one cohort, at least 20·k, "
                "at most all that federate)", ge=1, optional=True, source="library",
                note="after FlexCFL's α·m pre-training clients, α = 20"),
        integer("pretrain_epochs", None, "pretrain_kmeans: local epochs of the pre-training pass (null: "
                "train.local_epochs)", ge=1, optional=True, source="library"),
        choice("pretrain_embedding", "layers", ("layers", "updates", "edc"), "pretrain_kmeans: k-means on the "
               "flattened updates, on each weight tensor's update scaled to unit norm (layers), or on FlexCFL's EDC "
               "embedding of the updates", source="library", note="benchmarks/ifca_init.py"),
        Hyper("shared", "none", "weight sharing: none, all_but_last, or comma-separated parameter-name prefixes "
              "(averaged over all participants; the rest per cluster)", kind="text", source="paper",
              note="Alg. 2 shares no weights; sharing is the paper's extension for ambiguous clusters"),
    )

    @classmethod
    def check_config(cls, cfg):
        a = cfg.algorithm
        if a.init == "given" and not a.init_path:
            raise ValueError("algorithm.init_path: init=given needs a file of k stacked models; set algorithm.init_path")
        shared_parameters(a.shared, parameter_names(cfg.model.name, cfg.model.hidden))
        if is_auto(a.k) and a.init != "pretrain_kmeans":
            raise ValueError(f"algorithm.k: auto reads k from a pre-federation embedding of the clients' updates, which "
                             f"only init=pretrain_kmeans makes (given init={a.init}); set algorithm.init=pretrain_kmeans "
                             f"or a number of models")
        if (a.init == "pretrain_kmeans" and a.pretrain_clients is not None and not is_auto(a.k)
                and a.pretrain_clients < a.k):
            raise ValueError(f"algorithm.pretrain_clients: {a.pretrain_clients} clients cannot seed k={a.k} clusters; "
                             f"give at least {a.k} (or null)")
        if a.option == "gradient" and cfg.curriculum.ordering != "vanilla":
            raise ValueError("curriculum.ordering: IFCA option I (algorithm.option=gradient) takes one full-batch "
                             "gradient, which a data curriculum cannot pace; use curriculum.ordering=vanilla or "
                             "algorithm.option=model")
        n = cfg.partition.num_clients
        if a.init == "pretrain_kmeans" and a.pretrain_clients is not None and n is not None and a.pretrain_clients > n:
            raise ValueError(f"algorithm.pretrain_clients: {a.pretrain_clients} exceeds partition.num_clients={n}; "
                             "lower it (or null)")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.shared = shared_parameters(cfg.algorithm.shared, parameter_names(cfg.model.name, cfg.model.hidden))

    @property
    def num_models(self) -> int:
        """k; with k=auto one (θ_0) until the pre-federation step chooses k."""
        return 1 if is_auto(self.cfg.algorithm.k) else self.cfg.algorithm.k

    # ------------------------------------------------------------------ initialisation (ifca_init.py)
    def has_pre_federation(self) -> bool:
        """An instance method (the base's is a classmethod): only init=pretrain_kmeans with k > 1
        has a step before round 0 (with one model there is nothing to cluster, so k = 1 stays
        plain FedAvg with uniform weights)."""
        return self.cfg.algorithm.init == "pretrain_kmeans" and (is_auto(self.cfg.algorithm.k) or self.num_models > 1)

    def input_files(self) -> dict[str, str]:
        return ifca_init.input_files(self.cfg)

    def init_state(self, ctx: RunContext) -> ServerState:
        return ifca_init.initial_state(self.cfg, ctx, super().init_state(ctx), self.num_models, self.shared, self.select)

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """init=pretrain_kmeans: one pre-training pass from θ_0, k-means++ on the updates, and
        every cluster model starts at its members' mean trained model; each pre-training client
        uploads one model and receives one."""
        state, clients = ifca_init.pretrain_kmeans(self.cfg, ctx, state, self.shared, self.name)
        per_model = self.model_bytes(state)
        return state.replace(meta={**state.meta, "pre_federation_bytes": {"up": clients * per_model,
                                                                           "down": clients * per_model}})

    def draw_model(self, ctx: RunContext, g: torch.Generator) -> dict[str, torch.Tensor]:
        """One random model (DIFCA's reference_li draws every client's copies with it)."""
        return ifca_init.draw_model(self.cfg, ctx, g)

    def random_models(self, ctx: RunContext, attempt: int = 0) -> dict[str, torch.Tensor]:
        """The k random draws of restart ``attempt`` (model 0's shared parameters tied)."""
        return ifca_init.random_models(self.cfg, ctx, self.num_models, self.shared, attempt)

    # ------------------------------------------------------------------ evaluation and accounting
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return assign_by_min_loss(cluster_losses(state, ctx, np.arange(ctx.num_clients)))

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer takes the model with the lowest loss on its training data."""
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "lowest-loss model"

    def comm_bytes(self, state, clients):
        down, up = super().comm_bytes(state, clients)
        return down * state.k, up  # all k models go down, one comes back
