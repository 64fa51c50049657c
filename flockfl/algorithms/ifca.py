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

Initialisation (``algorithm.init``):

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

from flockfl import clustering
from flockfl.aggregation import flatten, rows, weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.auto import recorded
from flockfl.clustering.choose import Choice, choose_kmeans, cosine_distance
from flockfl.algorithms.hyper import Hyper, choice, integer, is_auto, real, text, weighting
from flockfl.algorithms.layout import parameter_names, shared_parameters, tie
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.client import round_spec, train_from
from flockfl.context import RunContext
from flockfl.engine.functional import index_params, stack
from flockfl.engine.schedule import LocalSpec
from flockfl.errors import ConfigError
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from models import init_params


class IFCA(Algorithm):
    name = "ifca"
    family = "clustered"
    one_cluster_is_fedavg = True
    paper = "Ghosh, Chung, Yin, Ramchandran, An Efficient Framework for Clustered Federated Learning, arXiv 2006.04088"
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

    def has_pre_federation(self) -> bool:
        """An instance method (the base's is a classmethod): only init=pretrain_kmeans with k > 1
        has a step before round 0 (with one model there is nothing to cluster, so k = 1 stays
        plain FedAvg with uniform weights)."""
        return self.cfg.algorithm.init == "pretrain_kmeans" and (is_auto(self.cfg.algorithm.k) or self.num_models > 1)

    # ------------------------------------------------------------------ initialisation
    def draw_model(self, ctx: RunContext, g: torch.Generator) -> dict[str, torch.Tensor]:
        """One random model: θ ~ Bernoulli(0.5)^d for the linear model (as the synthetic code), else the default init."""
        if self.cfg.model.name == "linear":
            return {n: torch.bernoulli(torch.full_like(p, 0.5), generator=g) for n, p in ctx.model.named_parameters()}
        return init_params(ctx.model, g)

    def random_models(self, ctx: RunContext, attempt: int = 0) -> dict[str, torch.Tensor]:
        purpose = "init" if attempt == 0 else f"init/restart{attempt}"
        return tie(stack([self.draw_model(ctx, torch_generator(ctx.seed, client=j, purpose=purpose))
                          for j in range(self.num_models)]), self.shared)

    def input_files(self) -> dict[str, str]:
        a = self.cfg.algorithm
        return {"init_path": a.init_path} if a.init == "given" else {}

    def given_models(self, ctx: RunContext) -> dict[str, torch.Tensor]:
        """init=given: the k stacked models of the file ``algorithm.init_path`` (read by the run's
        preparation into ``ctx.inputs``)."""
        path, obj = self.cfg.algorithm.init_path, ctx.inputs["init_path"]
        if isinstance(obj, list):
            obj = stack(obj)
        names = {n: p.shape for n, p in ctx.model.named_parameters()}
        if set(obj) != set(names) or any(tuple(obj[n].shape) != (self.num_models, *names[n]) for n in names):
            raise ConfigError(f"algorithm.init_path: {path} does not hold {self.num_models} models of this architecture")
        return tie({n: obj[n].to(torch.float32) for n in names}, self.shared)

    def init_state(self, ctx: RunContext) -> ServerState:
        state = super().init_state(ctx)
        a = self.cfg.algorithm
        if a.init == "given":
            return state.replace(models=self.given_models(ctx))
        models = self.random_models(ctx)  # pretrain_kmeans: model 0 is the shared start θ_0
        if a.init == "balanced_restart":
            cohort = self.select(state, ctx, 0)
            for attempt in range(a.max_tries):
                models = self.random_models(ctx, attempt)
                counts = np.bincount(assign_by_min_loss(cluster_losses(state.replace(models=models), ctx, cohort)),
                                     minlength=self.num_models)
                if counts.min() >= a.min_cluster_frac * len(cohort):
                    break
            state = state.replace(meta={**state.meta, "init_attempts": attempt + 1})
        return state.replace(models=models)

    def pretrain_cohort(self, ctx: RunContext) -> np.ndarray:
        """The clients that pre-train: ``pretrain_clients`` (default max(cohort, 20·k), at
        most every federating client) drawn from the (seed, "pretrain_clients") stream."""
        a, seen = self.cfg.algorithm, ctx.seen
        # k=auto: k unknown, so every federating client's evidence (or the given number)
        default = len(seen) if is_auto(a.k) else max(self.cfg.train.clients_per_round, 20 * a.k)
        want = a.pretrain_clients if a.pretrain_clients is not None else default
        count = min(want, len(seen))
        if not is_auto(a.k) and count < a.k:
            raise ConfigError(f"algorithm.pretrain_clients: only {count} clients can pre-train, fewer than k={a.k}")
        if count == len(seen):
            return seen.copy()
        return np.sort(np_rng(ctx.seed, purpose="pretrain_clients").choice(seen, size=count, replace=False)).astype(np.int64)

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        """init=pretrain_kmeans: one pre-training pass from θ_0, k-means++ on the updates, and
        every cluster model starts at its members' mean trained model."""
        a = self.cfg.algorithm
        theta0 = {k: v[0].clone() for k, v in state.models.items()}
        clients = self.pretrain_cohort(ctx)
        epochs = a.pretrain_epochs if a.pretrain_epochs is not None else self.cfg.train.local_epochs
        res = train_from(ctx, state, theta0, clients, epochs=epochs, stream="pretrain")
        # the updates Δ_i = θ_0 − θ_i, one float64 block per parameter (per weight tensor for ``layers``)
        names = list(theta0)
        if a.pretrain_embedding == "layers":
            names = [n for n in names if theta0[n].dim() >= 2] or names
        blocks = [flatten({n: theta0[n][None]}).double().cpu() - flatten({n: res.params[n]}).double().cpu() for n in names]
        if is_auto(a.k):
            choice = self.auto_k(blocks, ctx.seed)
            k = choice.k
            labels = choice.labels
            state = recorded(state, choice, "algorithm.k", self.name, -1, log=False, embedding=a.pretrain_embedding)
            models = {n: v[:1].expand(k, *v.shape[1:]).clone() for n, v in state.models.items()}
        else:
            k = a.k
            labels = clustering.kmeans_labels(clustering.update_embedding(blocks, a.pretrain_embedding, k), k, ctx.seed)
            models = {n: v.clone() for n, v in state.models.items()}
        for j in range(k):
            members = np.flatnonzero(labels == j)
            if len(members) == 0:  # fewer distinct updates than k: this model keeps its random draw
                continue
            mean = weighted_mean(rows(res.params, members), self.weights(res, members))
            for n in models:
                models[n][j] = mean[n]
        if self.shared:
            everyone = weighted_mean({k: res.params[k] for k in self.shared}, self.weights(res, np.arange(len(clients))))
            models = tie(models, self.shared, everyone)
        assignments = state.assignments.copy()
        assignments[clients] = labels
        state = state.replace(models=models, assignments=assignments, algo={
            **state.algo, "pretrain_clients": torch.from_numpy(clients), "pretrain_labels": torch.from_numpy(labels)})
        per_model = self.model_bytes(state)
        return state.replace(meta={**state.meta, "pretrain_cluster_sizes": np.bincount(labels, minlength=k).tolist(),
                                   "pre_federation_bytes": {"up": len(clients) * per_model, "down": len(clients) * per_model}})

    def auto_k(self, blocks: list[torch.Tensor], seed: int) -> Choice:
        """k=auto: k-means of the embedding at each k (with ``edc``, whose embedding depends on k,
        each k's EDC k-means), scored on the cosine distances of the updates Δ_i, one measure for
        every embedding (the ``layers`` embedding's own Euclidean distances put rotated digits'
        four groups at 0.23, under the floor; the updates' cosines at 0.44)."""
        how = self.cfg.algorithm.pretrain_embedding
        updates = torch.cat(blocks, 1).numpy()
        if how != "edc":
            return choose_kmeans(clustering.update_embedding(blocks, how, 1), seed, dist=cosine_distance(updates))
        return choose_kmeans(updates, seed, dist=cosine_distance(updates), partition=lambda rows, k: clustering.kmeans_labels(
            clustering.edc_embedding(updates[rows], k), k, seed))

    # ------------------------------------------------------------------ hooks
    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
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

    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return assign_by_min_loss(cluster_losses(state, ctx, np.arange(ctx.num_clients)))

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer takes the model with the lowest loss on its training data."""
        return state, assign_by_min_loss(cluster_losses(state, ctx, newcomers)), "lowest-loss model"

    def comm_bytes(self, state, clients):
        down, up = super().comm_bytes(state, clients)
        return down * state.k, up  # all k models go down, one comes back
