"""IFCA one-shot — Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
Learning", https://arxiv.org/abs/2006.04088, Algorithm 1 (spec §2.2).

Before round 0 every federating client computes a local ERM θ̃_i (``algorithm.erm``):
``least_squares`` (the closed form, for the linear model), or ``sgd``: ``erm_epochs``
epochs of local SGD (``train.lr``, ``train.batch_size``) from the common start θ_0, for any
classifier (``auto``: least squares for the linear model, else SGD). [lib] We use the
model's own ERM rather than the FEMNIST code's scikit-learn LogisticRegression, so the
method works for every architecture (with ``model.name=mclr`` SGD approximates the same
logistic-regression ERM). Each client uploads θ̃_i (counted in the pre-federation bytes);
the server runs k-means (scikit-learn, ``n_init=10``, ``random_state=seed``) on the
flattened solutions; then FedAvg (``weighting``, samples by default) inside each cluster,
with the assignment frozen. Cluster j starts at the mean of its members' θ̃_i
(``start=cluster_mean``) or at θ_0 (``init``). A newcomer computes its ERM and joins the
nearest k-means centre.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl import clustering
from flockfl.aggregation import flatten, mean_weights, rows, weighted_mean
from flockfl.algorithms.hyper import choice, integer, weighting
from flockfl.algorithms.oneshot import OneShotClustering
from flockfl.client import train_from
from flockfl.context import RunContext
from flockfl.errors import ConfigError
from flockfl.state import ServerState


def least_squares(ctx: RunContext, clients: np.ndarray) -> dict[str, torch.Tensor]:
    """θ̃_i = argmin_θ ‖X_i θ − y_i‖² for the linear model (float64 ``lstsq``; the minimum-norm
    solution when n_i < d), stacked as its one parameter."""
    (name, p), = ctx.model.named_parameters()
    solutions = []
    for c in clients:
        x, y = ctx.data.train.client(int(c))
        x = x.reshape(len(x), -1).double().cpu()
        solutions.append(torch.linalg.lstsq(x, y.double().cpu().reshape(-1, 1), driver="gelsd").solution.reshape(p.shape))
    return {name: torch.stack(solutions).to(p.dtype)}


class IFCAOneShot(OneShotClustering):
    """IFCA's one-shot clustering: k-means on the clients' local ERMs once, then FedAvg inside each cluster."""

    name = "ifca_oneshot"
    one_cluster_is_fedavg = True
    paper = "Ghosh, Chung, Yin, Ramchandran, An Efficient Framework for Clustered Federated Learning, arXiv 2006.04088 (Alg. 1)"
    hyperparameters = (
        weighting("samples", source="paper", note="Alg. 1: FedAvg inside each cluster"),
        integer("k", 2, "number of k-means clusters", "k", ge=1, source="paper",
                note="FEMNIST (Table 2): k = 2 or 3; otherwise the data's number of distributions"),
        choice("erm", "auto", ("auto", "least_squares", "sgd"), "local ERM: closed-form least squares (linear model), "
               "local SGD from θ_0, or auto (least squares for the linear model, else SGD)", source="library",
               note="the FEMNIST code fits scikit-learn's LogisticRegression; the model's own ERM works for every "
                    "architecture"),
        integer("erm_epochs", 5, "erm=sgd: local epochs of the ERM pass", ge=1, source="library"),
        choice("start", "cluster_mean", ("cluster_mean", "init"), "where cluster j's model starts: the mean of its "
               "members' ERM solutions, or θ_0", source="library", note="Alg. 1 does not say where FedAvg starts"),
    )

    @classmethod
    def check_config(cls, cfg):
        if cfg.algorithm.erm == "least_squares" and cfg.model.name != "linear":
            raise ValueError(f"algorithm.erm: least_squares is the closed form of the linear model; model.name="
                             f"{cfg.model.name} needs erm=sgd (or auto)")

    def erm_kind(self) -> str:
        e = self.cfg.algorithm.erm
        return ("least_squares" if self.cfg.model.name == "linear" else "sgd") if e == "auto" else e

    def local_erm(self, state: ServerState, ctx: RunContext, clients: np.ndarray, stream: str) -> dict[str, torch.Tensor]:
        if self.erm_kind() == "least_squares":
            return least_squares(ctx, clients)
        return train_from(ctx, state.algo["theta0"], clients, epochs=self.cfg.algorithm.erm_epochs, stream=stream).params

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        a = self.cfg.algorithm
        if len(ctx.seen) < a.k:
            raise ConfigError(f"algorithm.k: {a.k} clusters need at least {a.k} federating clients; lower it")
        theta0 = {k: v[0].clone() for k, v in state.models.items()}
        state = state.replace(algo={**state.algo, "theta0": theta0})
        params = self.local_erm(state, ctx, ctx.seen, "erm")
        x = flatten(params, list(theta0)).double().cpu().numpy()
        labels = clustering.kmeans_labels(x, a.k, ctx.seed)
        centres = clustering.kmeans_centres(x, labels, int(labels.max()) + 1)
        state = self.clustered_state(state, ctx, labels, {"centres": torch.from_numpy(centres)})
        if a.start == "cluster_mean":
            sizes = ctx.data.train.sizes[ctx.seen]
            models = {k: v.clone() for k, v in state.models.items()}
            for j in range(state.k):
                members = np.flatnonzero(labels == j)
                mean = weighted_mean(rows(params, members), mean_weights(sizes[members], self.weighting))
                for k in models:
                    models[k][j] = mean[k]
            state = state.replace(models=models)
        per_model = self.model_bytes(state)
        down = len(ctx.seen) * per_model if self.erm_kind() == "sgd" else 0  # θ_0 goes down for the SGD pass
        return state.replace(meta={**state.meta, "pre_federation_bytes": {"up": len(ctx.seen) * per_model, "down": down}})

    def admit_newcomers(self, state, ctx, newcomers):
        x = flatten(self.local_erm(state, ctx, newcomers, "newcomer/erm"), list(state.algo["theta0"])).double().cpu()
        centres = state.algo["centres"]
        assign = torch.cdist(x, centres.to(x.dtype)).argmin(1).numpy().astype(np.int64)
        return state, assign, "nearest k-means centre of its local ERM"
