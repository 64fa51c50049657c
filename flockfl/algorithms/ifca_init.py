"""IFCA's initialisation (``algorithm.init``; the four starts, and why, are described in
``flockfl/algorithms/ifca.py``'s docstring): module functions over the configuration, the run's
context and the server state, which IFCA's thin hooks call (``input_files``, ``init_state``,
``pre_federation``; DIFCA's reach them through IFCA's).

- ``random``: :func:`random_models`, k draws of :func:`draw_model` (streams (seed, j, "init"));
- ``balanced_restart``: :func:`initial_state` redraws (streams (seed, j, "init/restart<attempt>"))
  until every model wins ``min_cluster_frac`` of round 0's cohort, or ``max_tries`` draws;
- ``given``: :func:`given_models`, from the file :func:`input_files` names;
- ``pretrain_kmeans``: :func:`pretrain_kmeans`, the pre-federation step (its clients:
  :func:`pretrain_cohort`; with k=auto, k from :func:`auto_k`).

A shared module of the IFCA family only (ifca.py, and difca.py through IFCA): the import
contract ``algorithms`` in pyproject.toml leaves it out of the independence list on purpose.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flockfl import clustering
from flockfl.aggregation import flatten, mean_weights, rows, weighted_mean
from flockfl.algorithms.auto import recorded
from flockfl.algorithms.hyper import is_auto
from flockfl.algorithms.layout import tie
from flockfl.algorithms.model_choice import assign_by_min_loss, cluster_losses
from flockfl.client import train_from
from flockfl.clustering.choose import Choice, choose_kmeans, cosine_distance
from flockfl.config import ExperimentConfig
from flockfl.context import RunContext
from flockfl.engine.functional import stack
from flockfl.engine.trainers import TrainResult
from flockfl.errors import ConfigError
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from models import init_params

Models = dict[str, torch.Tensor]


def input_files(cfg: ExperimentConfig) -> dict[str, str]:
    """init=given reads ``algorithm.init_path`` (the run's preparation loads it into ``ctx.inputs``)."""
    a = cfg.algorithm
    return {"init_path": a.init_path} if a.init == "given" else {}


def draw_model(cfg: ExperimentConfig, ctx: RunContext, g: torch.Generator) -> Models:
    """One random model: θ ~ Bernoulli(0.5)^d for the linear model (as the synthetic code), else the default init."""
    if cfg.model.name == "linear":
        return {n: torch.bernoulli(torch.full_like(p, 0.5), generator=g) for n, p in ctx.model.named_parameters()}
    return init_params(ctx.model, g)


def random_models(cfg: ExperimentConfig, ctx: RunContext, k: int, shared: list[str], attempt: int = 0) -> Models:
    """k independent draws (restart ``attempt``), the ``shared`` parameters tied to model 0's."""
    purpose = "init" if attempt == 0 else f"init/restart{attempt}"
    return tie(stack([draw_model(cfg, ctx, torch_generator(ctx.seed, client=j, purpose=purpose))
                      for j in range(k)]), shared)


def given_models(cfg: ExperimentConfig, ctx: RunContext, k: int, shared: list[str]) -> Models:
    """init=given: the k stacked models of the file ``algorithm.init_path`` (read by the run's
    preparation into ``ctx.inputs``)."""
    path, obj = cfg.algorithm.init_path, ctx.inputs["init_path"]
    if isinstance(obj, list):
        obj = stack(obj)
    names = {n: p.shape for n, p in ctx.model.named_parameters()}
    if set(obj) != set(names) or any(tuple(obj[n].shape) != (k, *names[n]) for n in names):
        raise ConfigError(f"algorithm.init_path: {path} does not hold {k} models of this architecture")
    return tie({n: obj[n].to(torch.float32) for n in names}, shared)


def initial_state(cfg: ExperimentConfig, ctx: RunContext, state: ServerState, k: int, shared: list[str],
                  select: Callable[[ServerState, RunContext, int], np.ndarray]) -> ServerState:
    """Round 0's state with the k models of ``algorithm.init`` (``select``: the algorithm's
    cohort hook, whose round-0 cohort balanced_restart balances)."""
    a = cfg.algorithm
    if a.init == "given":
        return state.replace(models=given_models(cfg, ctx, k, shared))
    models = random_models(cfg, ctx, k, shared)  # pretrain_kmeans: model 0 is the shared start θ_0
    if a.init == "balanced_restart":
        cohort = select(state, ctx, 0)
        for attempt in range(a.max_tries):
            models = random_models(cfg, ctx, k, shared, attempt)
            counts = np.bincount(assign_by_min_loss(cluster_losses(state.replace(models=models), ctx, cohort)),
                                 minlength=k)
            if counts.min() >= a.min_cluster_frac * len(cohort):
                break
        state = state.replace(meta={**state.meta, "init_attempts": attempt + 1})
    return state.replace(models=models)


def pretrain_cohort(cfg: ExperimentConfig, ctx: RunContext) -> np.ndarray:
    """The clients that pre-train: ``pretrain_clients`` (default max(cohort, 20·k), at
    most every federating client) drawn from the (seed, "pretrain_clients") stream."""
    a, seen = cfg.algorithm, ctx.seen
    # k=auto: k unknown, so every federating client's evidence (or the given number)
    default = len(seen) if is_auto(a.k) else max(cfg.train.clients_per_round, 20 * a.k)
    want = a.pretrain_clients if a.pretrain_clients is not None else default
    count = min(want, len(seen))
    if not is_auto(a.k) and count < a.k:
        raise ConfigError(f"algorithm.pretrain_clients: only {count} clients can pre-train, fewer than k={a.k}")
    if count == len(seen):
        return seen.copy()
    return np.sort(np_rng(ctx.seed, purpose="pretrain_clients").choice(seen, size=count, replace=False)).astype(np.int64)


def _weights(res: TrainResult, members: np.ndarray, how: str) -> torch.Tensor:
    """p_i of the listed pre-trained clients (``algorithm.weighting``), as ``Algorithm.weights``."""
    return mean_weights(res.num_samples[members], how, next(iter(res.params.values())).device)


def pretrain_kmeans(cfg: ExperimentConfig, ctx: RunContext, state: ServerState, shared: list[str],
                    algorithm: str) -> tuple[ServerState, int]:
    """init=pretrain_kmeans: one pre-training pass from θ_0, k-means++ on the updates, and every
    cluster model starts at its members' mean trained model. (The state, the number of clients
    that pre-trained); ``algorithm``: the name a k=auto decision is recorded under."""
    a = cfg.algorithm
    theta0 = {k: v[0].clone() for k, v in state.models.items()}
    clients = pretrain_cohort(cfg, ctx)
    epochs = a.pretrain_epochs if a.pretrain_epochs is not None else cfg.train.local_epochs
    res = train_from(ctx, theta0, clients, epochs=epochs, stream="pretrain")
    # the updates Δ_i = θ_0 − θ_i, one float64 block per parameter (per weight tensor for ``layers``)
    names = list(theta0)
    if a.pretrain_embedding == "layers":
        names = [n for n in names if theta0[n].dim() >= 2] or names
    blocks = [flatten({n: theta0[n][None]}).double().cpu() - flatten({n: res.params[n]}).double().cpu() for n in names]
    if is_auto(a.k):
        choice = auto_k(blocks, ctx.seed, a.pretrain_embedding)
        k = choice.k
        labels = choice.labels
        state = recorded(state, choice, "algorithm.k", algorithm, -1, log=False, embedding=a.pretrain_embedding)
        models = {n: v[:1].expand(k, *v.shape[1:]).clone() for n, v in state.models.items()}
    else:
        k = a.k
        labels = clustering.kmeans_labels(clustering.update_embedding(blocks, a.pretrain_embedding, k), k, ctx.seed)
        models = {n: v.clone() for n, v in state.models.items()}
    for j in range(k):
        members = np.flatnonzero(labels == j)
        if len(members) == 0:  # fewer distinct updates than k: this model keeps its random draw
            continue
        mean = weighted_mean(rows(res.params, members), _weights(res, members, a.weighting))
        for n in models:
            models[n][j] = mean[n]
    if shared:
        everyone = weighted_mean({k: res.params[k] for k in shared}, _weights(res, np.arange(len(clients)), a.weighting))
        models = tie(models, shared, everyone)
    assignments = state.assignments.copy()
    assignments[clients] = labels
    state = state.replace(models=models, assignments=assignments, algo={
        **state.algo, "pretrain_clients": torch.from_numpy(clients), "pretrain_labels": torch.from_numpy(labels)})
    return state.replace(meta={**state.meta, "pretrain_cluster_sizes": np.bincount(labels, minlength=k).tolist()}), len(clients)


def auto_k(blocks: list[torch.Tensor], seed: int, how: str) -> Choice:
    """k=auto: k-means of the embedding ``how`` at each k (with ``edc``, whose embedding depends on k,
    each k's EDC k-means), scored on the cosine distances of the updates Δ_i, one measure for
    every embedding (the ``layers`` embedding's own Euclidean distances put rotated digits'
    four groups at 0.23, under the floor; the updates' cosines at 0.44)."""
    updates = torch.cat(blocks, 1).numpy()
    if how != "edc":
        return choose_kmeans(clustering.update_embedding(blocks, how, 1), seed, dist=cosine_distance(updates))
    return choose_kmeans(updates, seed, dist=cosine_distance(updates), partition=lambda rows, k: clustering.kmeans_labels(
        clustering.edc_embedding(updates[rows], k), k, seed))
