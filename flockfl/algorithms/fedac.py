"""FedAC — Zhang, Chen, Lin, Chen, Zhao, "FedAC: An Adaptive Clustered Federated Learning
Framework for Heterogeneous Data", https://arxiv.org/abs/2403.16460 (seed 000; spec
``core-and-clustered-algorithms.md`` §3.3, which resolves the seed's typos: the E-step is an
argmax of LrCos, not an argmin, and Φ is an average, not a sum).

**Model split.** ω = (φ, h): the embedding φ and the decision h (``algorithm.decision_layers``).
By default (null) every conv and BatchNorm layer is φ and the Linear layers are h (LeNet-5: the
two convs are φ, the three Linear layers h); a model without conv layers (MLP, MCLR) puts its
last Linear layer in h and the layers before it in φ [lib]. An integer n puts the last n Linear
layers in h and everything before them in φ (φ may be empty: the λ-term then vanishes).

**Clients** are stateful: ω_i persists between rounds, and a sampled client starts from its own
ω_i, not from a server model. Each local SGD step on a batch B is

    ω ← ω − η ∇ℓ_i(ω; B) − ημ(ω − Ω_k*) − ηλ(φ − Φ)        (the λ-term touches only φ)

with Ω_k* the centroid of the client's cluster and Φ the global embedding, both frozen for the
round. The trainers take it as a per-parameter proximal term: μ + λ towards
(μΩ_φ + λΦ)/(μ + λ) on φ, μ towards Ω_h on h (``LocalSpec.prox_mu`` as a dict).

**Server, each round** (all in ``aggregate``; ``cluster`` keeps the base rule, the centroid each
client trained towards):

1. store the participants' ω_i;
2. Φ ← Σ_{i∈S_t} p_i φ_i with p_i ∝ n_i (``algorithm.weighting=samples``) or uniform;
3. LrCos: every ``pca_refresh_every`` rounds, M ← the top D right singular vectors of the
   centred |S_t| × dim matrix of the participants' vectors (economy SVD, through the
   |S_t| × |S_t| Gram matrix; D ≤ |S_t| − 1; with fewer than 2 participants M is kept);
   LrCos(ω, Ω) = ⟨Mω, MΩ⟩ / (‖Mω‖‖MΩ‖), on the uncentred vectors by default (scale-invariant)
   or on ω − mean(H) (``center_before_project``); the vectors are the full ω or only h
   (``lrcos_on``);
4. E-step: R_i = argmax_k LrCos(ω_i, Ω_k) (ties: the lowest k), over every client the server
   holds a model of (``e_step=all``) or over S_t only;
5. M-step: Ω_k = the uniform mean of its members' latest ω_i; empty clusters are removed;
6. Cluster Number Tuning: for every cluster, G_c^k = Dist_intra^k / Dist_inter^k with
   Dist_intra^k = mean_{i∈k} ‖ω_i − Ω_k‖² and Dist_inter^k = (1/(K−1)) Σ_j ‖Ω_k − Ω_j‖². All G
   are computed first; then, in increasing G, a cluster with G < a merges into its nearest
   cluster (by ‖Ω_k − Ω_j‖) unless either is already in a merge (merges never chain in one
   pass; none when K = 1); then every other cluster with G > b and ≥ 2 members splits in two
   by 2-means on its members' projected vectors Mω_i under cosine (spherical 2-means seeded
   deterministically with the two least similar members). Centroids are recomputed as member
   means. With K = 1 there is no other centroid: [lib] Dist_inter is then ‖Ω_1‖², the distance
   to the zero model (so a single cluster can still split).

The distances of CNT are taken on the same coordinates as LrCos (all of ω, or h). [lib]
``cnt_warmup`` rounds pass before the first CNT and then it runs every ``cnt_every`` rounds
(defaults 0 and 1: every round, as the seed). G_c is a ratio of raw parameter distances and
drifts with training: on rotated digits the G_c of a true group falls from ≈ 0.55 (round 5) to
≈ 0.22 (round 80), so fixed thresholds a, b act differently early and late (see
``benchmarks/fedac_k.py``). Over-split pieces of one group have a G_c only ≈ 20 % below a whole
group's, so a merge is reliable only for near-degenerate (tiny) clusters, as the paper intends.

**Initialisation** [lib, the spec's default]: every ω_i^0 = Ω_k^0 = ω^0 (one random init, the
same draw as every other algorithm's global model), Φ^0 = φ^0, R^0 random balanced over
K⁰ = ``algorithm.k`` clusters (stream (seed, "fedac_init_assign")). As all Ω_k^0 are equal, an
E-step against them would put everyone in cluster 0; so the first time the server has client
models it runs an M-step from R^0 first (k-means from a random partition), then E and M.

**Clients never heard from** [lib]. The server has no model of a client that never trained
(its ω_i is still ω^0, which says nothing about its data), so the E- and M-steps run over the
clients that have uploaded at least once; after the first fit the others have R_i = −1, and if
sampled they train from ω^0 towards the centroid that LrCos picks for ω^0.

**State** (all in ``ServerState``, so in the digest and the checkpoint): ``models`` holds the K
centroids Ω_k; ``assignments`` is R (−1: no model yet); ``algo`` holds ``omega`` (a
:class:`~flockfl.clientstate.ClientTable`, one flat float32 row per client that has trained; the
others read ω^0; a checkpoint writes only the rows that changed), ``omega0`` (ω^0), ``phi`` (Φ),
``pca``/``pca_mean`` (M and its centring mean), ``pca_round`` and ``fitted``. The store is at most
N × dim(ω) × 4 bytes (N = 1000: 4.9 MB for the digits MLP 64-16-10, 636 MB for the 784-200-10
MNIST MLP), plus K + 2 models and M; a server step copies it once (the old state stays intact).

**Evaluation**: each federating client with its own ω_i (``accuracy``, ``loss``,
``cluster/{k}/accuracy``) and with its centroid Ω_{R_i} (``accuracy_centroid``); ``num_clusters``
= K; ``ari``/``nmi`` compare R with the true groups (no model: label −1). History rows add
``k_clusters`` (K after CNT), ``clusters_merged`` and ``clusters_split``. Fine-tuning starts from
ω_i; a newcomer takes the centroid with the lowest training loss. The paper's hyper-parameter
defaults are not recoverable from the seed: the defaults are the spec's placeholders.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import Hyper, choice, integer, real, weighting
from flockfl.algorithms.layout import Layout, split_layout
from flockfl.client import round_spec
from flockfl.clientstate import ClientTable
from flockfl.algorithms.auto import recorded
from flockfl.algorithms.hyper import is_auto
from flockfl.clustering.choose import Choice, choose_cut
from flockfl.clustering.lrcos import Tuning, coordinates, e_step, em_step, lrcos, m_step, pca_map
from flockfl.context import RunContext
from flockfl.eval_protocol import family, protocol
from flockfl.evaluation import client_model_losses, cluster_breakdown, measure_shared
from flockfl.engine.functional import index_params
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState, log_round
from models import init_params


# the spec's placeholders (spec §3.3): the paper's values are not recoverable from the seed
PLACEHOLDER = {"source": "library", "note": "the spec's placeholder; the paper's value is not recoverable"}


class FedAC(Algorithm):
    name = "fedac"
    family = "clustered"
    device_state_keys = ("omega0", "phi", "pca", "pca_mean")  # flat tensors kept with the centroids
    personal = True  # each client is evaluated with its own ω_i
    finetune_momentum = False  # [kept as it was] FedAC's fine-tuning has never used train.momentum
    paper = "Zhang et al., FedAC: An Adaptive Clustered Federated Learning Framework for Heterogeneous Data, arXiv 2403.16460"
    hyperparameters = (
        replace(weighting("samples", source="library", note="Φ^{t+1} is printed as a sum of the φ_i; an n_i-weighted "
                          "mean"), meaning="weights of the participants' embeddings in the global embedding Φ: "
                "samples (n_i) or uniform"),
        integer("k", 4, "initial number of clusters (Cluster Number Tuning changes it); auto: one cluster at first, then "
                "each tuning round K comes from the data (the average-linkage cut of the clients' projected models under "
                "1 − LrCos with the best silhouette, flockfl.clustering.choose) instead of the a/b rule ('FedAC + auto K' "
                "in tables)", "K⁰", ge=1, auto=True, **PLACEHOLDER),
        real("mu", 0.01, "pull of ω_i towards its cluster centroid, (μ/2)‖ω_i − Ω_k*‖²", "μ", ge=0, **PLACEHOLDER),
        real("lam", 0.01, "pull of the embedding φ_i towards the global embedding, (λ/2)‖φ_i − Φ‖²", "λ", ge=0,
             **PLACEHOLDER),
        integer("components", None, "PCA components of LrCos (null: min(|S_t| − 1, 10))", "D", ge=1, optional=True,
                source="library", note="economy SVD of the centred participants' models: D ≤ |S_t| − 1"),
        Hyper("center_before_project", False, "LrCos on M(ω − mean of the participants) instead of Mω "
              "(uncentred, scale-invariant)", "", "bool", source="paper",
              note="Alg. 2: LrCos = ⟨Mω_i, MΩ_k⟩/(‖Mω_i‖‖MΩ_k‖), uncentred as written"),
        integer("pca_refresh_every", 1, "recompute the PCA map M every this many rounds, reusing it in between", ge=1,
                source="library", note="the paper 'proceeds sparsely' without a period"),
        choice("lrcos_on", "model", ("model", "decision"), "the vectors of LrCos and CNT: all of ω, or only the "
               "decision layers h (cheaper)", source="paper", note="Alg. 2: H = [ω_1, …], the whole models"),
        choice("e_step", "all", ("all", "participants"), "E-step over every client the server holds a model of, or "
               "over this round's participants only", source="paper",
               note="the E-step assigns all m clients (their last known ω_i)"),
        real("merge_threshold", 0.1, "CNT: a cluster with G_c below it merges into its nearest cluster", "a", ge=0,
             **PLACEHOLDER),
        real("split_threshold", 1.0, "CNT: a cluster with G_c above it splits in two", "b", gt=0, **PLACEHOLDER),
        integer("cnt_warmup", 0, "rounds without Cluster Number Tuning at the start (G_c means little while the "
                "models are still close to their common init)", ge=0, source="library",
                note="Alg. 3 tunes from the first round"),
        integer("cnt_every", 1, "run Cluster Number Tuning every this many rounds (after the warm-up)", ge=1,
                source="library", note="Alg. 3 runs every round"),
        integer("decision_layers", None, "the last n Linear layers form the decision h, the rest the embedding φ "
                "(null: conv/BN layers are φ and the Linear layers h; without convs, the last Linear layer is h)",
                "", ge=1, optional=True, source="library",
                note="the paper: shallow convolutional layers φ, deep fully connected layers h"),
    )

    @classmethod
    def check_config(cls, cfg):
        a = cfg.algorithm
        if a.split_threshold <= a.merge_threshold:
            raise ValueError(f"algorithm.split_threshold: {a.split_threshold!r} must exceed "
                             f"algorithm.merge_threshold={a.merge_threshold!r} (a < b)")

    # ------------------------------------------------------------------ helpers
    def layout(self, ctx: RunContext) -> Layout:
        cached = getattr(self, "_layout", None)
        if cached is None or cached[0] is not ctx.model:
            self._layout = (ctx.model, split_layout(ctx.model, self.hp("decision_layers")))
        return self._layout[1]

    def cols(self, ctx: RunContext) -> Optional[torch.Tensor]:
        """The coordinates of LrCos and CNT (None: all of ω)."""
        lay = self.layout(ctx)
        return None if self.hp("lrcos_on") == "model" else lay.columns(lay.decision).to(self.device(ctx))

    @staticmethod
    def device(ctx: RunContext) -> torch.device:
        return ctx.data.train.x.device

    def omegas(self, state: ServerState, clients: np.ndarray) -> torch.Tensor:
        """[C, dim] current ω_i of the listed clients (ω^0 for a client with no row)."""
        return state.algo["omega"].gather(clients, state.algo["omega0"].device)["omega"]

    def pca_mean(self, state: ServerState) -> Optional[torch.Tensor]:
        """The mean LrCos subtracts before projecting (``center_before_project``), else None."""
        return state.algo["pca_mean"] if self.hp("center_before_project") and len(state.algo["pca"]) else None

    def projected(self, state: ServerState, ctx: RunContext, x: torch.Tensor) -> torch.Tensor:
        return coordinates(x, state.algo["pca"], self.pca_mean(state), self.cols(ctx))

    def centroid_of_untrained(self, state: ServerState, ctx: RunContext) -> int:
        """The E-step for ω^0 (clients the server has no model of)."""
        lay = self.layout(ctx)
        cent = lay.flatten(state.models)
        w0 = self.projected(state, ctx, state.algo["omega0"][None])
        return int(e_step(lrcos(w0, self.projected(state, ctx, cent)))[0])

    # ------------------------------------------------------------------ state
    def init_state(self, ctx: RunContext) -> ServerState:
        lay = self.layout(ctx)
        n, k0 = ctx.num_clients, 1 if is_auto(self.hp("k")) else self.hp("k")
        device = self.device(ctx)
        theta0 = init_params(ctx.model, torch_generator(ctx.seed, client=0, purpose="init"))  # every algorithm's θ_0
        w0 = lay.flatten({k: v[None] for k, v in theta0.items()})[0].to(device)
        labels = np.arange(n) % k0
        r0 = labels[np_rng(ctx.seed, purpose="fedac_init_assign").permutation(n)].astype(np.int64)
        phi_cols = lay.columns(lay.embedding).to(device)
        cols = self.cols(ctx)
        width = lay.dim if cols is None else len(cols)
        return ServerState(
            round=0, models={k: v.contiguous() for k, v in lay.unflatten(w0[None].expand(k0, -1)).items()}, assignments=r0,
            assignment_history=np.zeros((0, n), np.int64),
            algo={"omega": ClientTable(n, {"omega": w0}),
                  "omega0": w0, "phi": w0[phi_cols].clone(), "pca": torch.zeros(0, width, device=device),
                  "pca_mean": torch.zeros(width, device=device), "pca_round": torch.tensor(-1),
                  "fitted": torch.tensor(False)},
            meta={"rng": "numpy PCG64(SeedSequence([seed, round+1, client+1, crc32(purpose)]))", "algorithm": self.name},
        )

    # ------------------------------------------------------------------ hooks
    def model_of(self, state: ServerState, ctx: RunContext, clients: np.ndarray) -> np.ndarray:
        """k*(i): the client's cluster; for a client without a model, the LrCos choice for ω^0."""
        k = state.assignments[np.asarray(clients, np.int64)].copy()
        if (k < 0).any():
            k[k < 0] = self.centroid_of_untrained(state, ctx)
        return k

    def local_spec(self, state: ServerState, ctx: RunContext, clients: np.ndarray, round: int) -> LocalSpec:
        t, lay = self.cfg.train, self.layout(ctx)
        mu, lam = float(self.hp("mu")), float(self.hp("lam"))
        which = self.model_of(state, ctx, clients)
        init = lay.unflatten(self.omegas(state, clients))
        anchor = index_params(state.models, torch.from_numpy(which))
        prox = {n: mu for n in lay.names}
        if mu + lam > 0:
            phi = lay.unflatten(lay.scatter(lay.embedding, state.algo["phi"], len(clients)))
            for n in lay.embedding:
                anchor[n] = (mu * anchor[n] + lam * phi[n]) / (mu + lam)
                prox[n] = mu + lam
        spec = round_spec(t, clients, init, meta={"model_of_client": which}, client_epochs=self.local_work(ctx, clients, round))
        if any(prox.values()):
            spec.prox_mu, spec.prox_anchor = prox, anchor
        return spec

    def aggregate(self, state: ServerState, ctx: RunContext, spec: LocalSpec, result: TrainResult,
                  assign: np.ndarray) -> ServerState:
        lay, a = self.layout(ctx), self.cfg.algorithm
        algo = dict(state.algo)
        clients = np.asarray(result.clients, np.int64)
        # 1. store the participants' ω_i (a new row for a client's first upload)
        x_new = lay.flatten(result.params).to(algo["omega0"].device)
        table = algo["omega"].scatter(clients, {"omega": x_new})  # a new table: the old state stays intact
        algo["omega"] = table
        # 2. the global embedding Φ: the p_i-weighted mean of the participants' φ_i
        phi_cols = lay.columns(lay.embedding).to(x_new.device)
        algo["phi"] = weighted_mean({"phi": x_new[:, phi_cols]}, self.weights(result, np.arange(len(clients))))["phi"]
        # 3. the PCA map M, from the participants' vectors, every pca_refresh_every rounds
        cols = self.cols(ctx)
        due = int(algo["pca_round"]) < 0 or state.round - int(algo["pca_round"]) >= a.pca_refresh_every
        if due and len(clients) >= 2:
            m, mean = pca_map(x_new if cols is None else x_new[:, cols], a.components)
            algo.update(pca=m, pca_mean=mean, pca_round=torch.tensor(state.round))
        new = state.replace(algo=algo)
        # 4–6. E-step, M-step, Cluster Number Tuning over the clients the server holds a model of
        known = np.flatnonzero(table.written())
        x = table.gather(known, x_new.device)["omega"]  # rows in client order
        # labels: R^0 before the first fit (Ω_k^0 are all ω^0: fit them to R^0 first, k-means from a
        # random partition); afterwards every known client but this round's first uploads
        # (participants, so in every E-step's scope) has one
        cent = lay.flatten(state.models) if bool(algo["fitted"]) else None
        scope = np.isin(known, clients) if a.e_step == "participants" else np.ones(len(known), bool)
        due = state.round >= a.cnt_warmup and (state.round - a.cnt_warmup) % a.cnt_every == 0
        auto_k = is_auto(a.k)
        rule = due and not auto_k  # the seed's a/b rule
        tuned = em_step(x, state.assignments[known], cent, scope, algo["pca"], self.pca_mean(new), cols,
                        a.merge_threshold if rule else -np.inf, a.split_threshold if rule else np.inf)
        if due and auto_k:
            tuned, choice = self.auto_tuning(x, tuned, x if cols is None else x[:, cols])
            new = recorded(new, choice, "algorithm.k", self.name, state.round)
        assignments = np.full(ctx.num_clients, -1, np.int64)
        assignments[known] = tuned.labels
        algo["fitted"] = torch.tensor(True)
        models = {k: v.contiguous() for k, v in lay.unflatten(tuned.centroids).items()}
        # G_c of this round's clusters before tuning
        new = new.replace(models=models, assignments=assignments, algo=algo,
                          meta={**new.meta, "fedac_gc": [float(g) for g in tuned.g]})
        log_round(new, k_clusters=len(tuned.centroids), clusters_merged=tuned.merged, clusters_split=tuned.split)
        return new

    @staticmethod
    def auto_tuning(x: torch.Tensor, tuned: Tuning, coords: torch.Tensor) -> tuple[Tuning, Choice]:
        """``k=auto``'s Cluster Number Tuning: K from the clients' models (the cut of their
        average-linkage dendrogram under the Euclidean distances of CNT's coordinates with the best
        silhouette, nested groups and the one-cluster test as every ``auto`` key). These distances
        are those of the models projected on *all* their principal components (a projection on
        the span of the centred models keeps every pairwise distance); LrCos's D ≤ 10 components
        would not do: 32 IID clients in 10 dimensions show silhouettes ≈ 0.3 at k ≈ 15, noise
        that looks like structure in few dimensions. When the chosen K differs from the EM
        step's, the chosen partition replaces it (centroids: its members' means); else the EM
        step stands."""
        c = coords.double()
        choice = choose_cut(torch.cdist(c, c).cpu().numpy(), "average")
        k = len(tuned.centroids)
        if choice.k == k:
            return tuned, choice
        centroids, labels = m_step(x, choice.labels)
        return Tuning(labels, centroids, max(0, k - choice.k), max(0, choice.k - k), tuned.g), choice

    # ------------------------------------------------------------------ evaluation
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return state.assignments

    def own_models(self, state: ServerState, ctx: RunContext, clients: np.ndarray, assign: np.ndarray
                   ) -> dict[str, torch.Tensor]:
        """Each client's own ω_i; a client the server has no model of: the centroid it is given
        (a newcomer), else ω^0."""
        lay = self.layout(ctx)
        x = self.omegas(state, clients)
        given = ~state.algo["omega"].written(clients) & (np.asarray(assign) >= 0)
        if given.any():
            x = x.clone()
            x[torch.from_numpy(given)] = lay.flatten(state.models)[torch.from_numpy(np.asarray(assign)[given])]
        return lay.unflatten(x)

    def cluster_metrics(self, state, ctx, clients, mine, c_loss, c_acc, n):
        """The base breakdown with ``num_clusters`` = K, and ``accuracy_centroid``/``loss_centroid``:
        each client with its centroid Ω_{R_i}."""
        base = cluster_breakdown(ctx, clients, mine, c_loss, c_acc, n, state.k)
        out = {k: v for k, v in base.items() if k.startswith("cluster/")}
        has = mine >= 0
        if has.any():
            cm = measure_shared(ctx, state.models, mine[has], clients[has])
            out.update(family(cm, protocol(ctx), ctx.data.task, "_centroid", keys=("accuracy_centroid", "loss_centroid")))
        out.update(base, num_clusters=state.k)
        return out

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer evaluates the K centroids on its training data and takes the best."""
        loss, _, _ = client_model_losses(ctx.model, state.models, ctx.data.train, newcomers, ctx.data.task)
        return state, np.argmin(loss.numpy(), axis=0).astype(np.int64), "the centroid with the lowest training loss"

    # ------------------------------------------------------------------ accounting
    def comm_bytes(self, state: ServerState, clients: np.ndarray) -> tuple[int, int]:
        """Down: Ω_k* and Φ per client; up: ω_i."""
        per_model = self.model_bytes(state)
        phi = state.algo["phi"]
        return len(clients) * (per_model + phi.numel() * phi.element_size()), len(clients) * per_model

