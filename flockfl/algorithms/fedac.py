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

**State and memory** (all in ``ServerState``, so in the digest and the checkpoint):
``models`` holds the K centroids Ω_k; ``assignments`` is R (−1: no model yet); ``algo`` holds
``omega`` (a :class:`~flockfl.clientstate.ClientTable` of one flat float32 row per client; a
client that never trained reads ω^0 and counts as unknown; a round writes only its participants'
rows, and a checkpoint only the rows that changed), ``omega0`` (ω^0), ``phi`` (Φ), ``pca`` and
``pca_mean`` (M and the mean it was centred with), ``pca_round`` and ``fitted``. The store grows
only with the clients that have trained: for N = 1000 clients it is at most 1000 × dim(ω) × 4
bytes plus 8 KB of row indices — 4.9 MB for the digits MLP (64-16-10, 1210 parameters), 636 MB
for the 784-200-10 MNIST MLP (159,010 parameters) — plus K + 2 models and M (D × dim); the
server step copies the store once (the old state stays intact), so its peak is twice that.

**Evaluation**: each federating client with its own ω_i on its test split (``accuracy``,
``loss``, per cluster ``cluster/{k}/accuracy``); ``accuracy_centroid`` is the same with the
cluster models Ω_{R_i}; ``num_clusters`` = K and ``ari``/``nmi`` compare R with the true groups
(a client without a model counts as its own label −1). Every round's history row has
``k_clusters`` (K after CNT), ``clusters_merged`` and ``clusters_split``. Fine-tuning
(``train.eval_finetune``) starts from the client's own ω_i; a newcomer takes the centroid with
the lowest loss on its training data.

Hyper-parameters (``algorithm.*``; paper defaults are not recoverable from the seed, these are
the spec's placeholders; ``flock list fedac`` shows each with its range):

=====================  =========  ======  ==================================================
key                    default    symbol  meaning
=====================  =========  ======  ==================================================
k                      4          K⁰      initial number of clusters (≥ 1; CNT changes it)
mu                     0.01       μ       pull of ω_i towards its centroid (≥ 0)
lam                    0.01       λ       pull of φ_i towards Φ (≥ 0)
weighting              samples    p_i     weights of Φ's mean: samples (n_i) or uniform
components             null       D       PCA components (≥ 1; null: min(|S_t| − 1, 10))
center_before_project  false              LrCos on M(ω − mean) instead of Mω
pca_refresh_every      1                  recompute M every this many rounds (≥ 1)
lrcos_on               model              vectors of LrCos and CNT: model (ω) or decision (h)
e_step                 all                E-step over all known clients or participants
merge_threshold        0.1        a       merge when G_c < a (≥ 0)
split_threshold        1.0        b       split when G_c > b (> 0, and > a)
cnt_warmup             0                  rounds before the first CNT (≥ 0)
cnt_every              1                  CNT every this many rounds (≥ 1)
decision_layers        null               last n Linear layers form h (≥ 1; null: see above)
=====================  =========  ======  ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
from torch import nn

from flockfl.clientstate import ClientTable
from flockfl.algorithms.base import Algorithm
from flockfl.context import RunContext
from flockfl.evaluation import client_model_losses, own_cluster_metrics, own_model_metrics, summarise_clients
from flockfl.state import log_round
from flockfl.algorithms.hyper import Hyper, choice, integer, real, weighting
from flockfl.errors import ConfigError
from flockfl.engine.functional import index_params
from flockfl.engine.schedule import LocalSpec
from flockfl.engine.trainers import TrainResult
from flockfl.rng import np_rng, torch_generator
from flockfl.state import ServerState
from models import init_params

# ---------------------------------------------------------------------- the model split


@dataclass(frozen=True)
class Layout:
    """How a model's parameters lie in one flat vector, and which of them are φ and h."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # start of each parameter; offsets[-1] = dim
    embedding: tuple[str, ...]  # φ
    decision: tuple[str, ...]  # h

    @property
    def dim(self) -> int:
        return self.offsets[-1]

    def columns(self, names) -> torch.Tensor:
        """The flat coordinates of the listed parameters (in layout order)."""
        keep = set(names)
        parts = [torch.arange(self.offsets[i], self.offsets[i + 1]) for i, n in enumerate(self.names) if n in keep]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stacked parameters → [n, dim]."""
        n = params[self.names[0]].shape[0]
        return torch.cat([params[k].reshape(n, -1) for k in self.names], 1)

    def unflatten(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """[n, dim] → stacked parameters (views of x)."""
        return {k: x[:, self.offsets[i]:self.offsets[i + 1]].reshape(len(x), *self.shapes[i])
                for i, k in enumerate(self.names)}


def split_layout(model: nn.Module, decision_layers: Optional[int] = None) -> Layout:
    """ω = (φ, h) for ``model``: see the module docstring (``algorithm.decision_layers``)."""
    params = list(model.named_parameters())
    owner = {n: n.rsplit(".", 1)[0] if "." in n else "" for n, _ in params}
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    conv_bn = {name for name, m in model.named_modules()
               if isinstance(m, (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase))}
    if decision_layers is not None:
        if decision_layers > len(linears):
            raise ConfigError(f"algorithm.decision_layers: {decision_layers} exceeds the {len(linears)} Linear layers "
                              "of this model; lower it")
        head = set(linears[len(linears) - decision_layers:])
        decision = [n for n, _ in params if owner[n] in head]
    elif conv_bn:
        decision = [n for n, _ in params if owner[n] not in conv_bn]
    else:
        decision = [n for n, _ in params if owner[n] == (linears[-1] if linears else None)]
    offsets = np.cumsum([0] + [p.numel() for _, p in params]).tolist()
    return Layout(tuple(n for n, _ in params), tuple(tuple(p.shape) for _, p in params), tuple(offsets),
                  tuple(n for n, _ in params if n not in decision), tuple(decision))


# ---------------------------------------------------------------------- LrCos, E/M steps, CNT (pure)


def pca_map(h: torch.Tensor, components: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, mean): M is the [D, dim] matrix of the top right singular vectors of the centred rows
    of ``h`` (D = min(components or 10, n − 1, numerical rank)), mean the rows' mean.

    The economy SVD is taken through the n × n Gram matrix (n = participants ≪ dim): its
    eigenvectors U give V = Hᵀ U / s, which is cheap and deterministic for wide matrices."""
    mean = h.mean(0)
    centred = (h - mean).double()
    evals, evecs = torch.linalg.eigh(centred @ centred.T)  # ascending
    s2, u = evals.flip(0), evecs.flip(1)
    limit = min(components if components is not None else 10, len(h) - 1)
    rank = int((s2 > max(float(s2[0]), 0.0) * 1e-10).sum()) if len(s2) and s2[0] > 0 else 0
    d = max(0, min(limit, rank))
    v = (centred.T @ u[:, :d]) / s2[:d].sqrt()
    return v.T.to(h.dtype).contiguous(), mean


def project(x: torch.Tensor, m: torch.Tensor, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mx for every row (x − mean when ``mean`` is given); raw x when M has no rows."""
    x = x - mean if mean is not None else x
    return x @ m.T if len(m) else x


def lrcos(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[n, K] cosine of every projected client vector with every projected centroid."""
    pn = p / p.norm(dim=1, keepdim=True).clamp_min(1e-30)
    qn = q / q.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return pn @ qn.T


def e_step(sim: torch.Tensor) -> np.ndarray:
    """R_i = argmax_k LrCos(ω_i, Ω_k), ties to the lowest k (the seed's argmin is a typo)."""
    return np.argmax(sim.cpu().numpy(), axis=1).astype(np.int64)


def m_step(x: torch.Tensor, labels: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """(centroids, labels): Ω_k = mean of the rows labelled k; empty clusters are dropped and
    the rest renumbered 0..K'−1 in their old order."""
    kept = np.unique(labels)
    new = np.searchsorted(kept, labels).astype(np.int64)
    cent = torch.stack([x[_idx(np.flatnonzero(new == j), x.device)].mean(0) for j in range(len(kept))])
    return cent, new


def gc_ratios(x: torch.Tensor, labels: np.ndarray, centroids: torch.Tensor) -> np.ndarray:
    """G_c^k = Dist_intra^k / Dist_inter^k for every cluster (K = 1: Dist_inter = ‖Ω_1‖²)."""
    k = len(centroids)
    c64 = centroids.double()
    intra = np.array([float(((x[_idx(np.flatnonzero(labels == j), x.device)].double() - c64[j]) ** 2).sum(1).mean())
                      for j in range(k)])
    if k == 1:
        inter = np.array([float((c64[0] ** 2).sum())])
    else:
        inter = (torch.cdist(c64, c64) ** 2).sum(1).cpu().numpy() / (k - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, intra / np.where(inter > 0, inter, 1.0), np.where(intra > 0, np.inf, 0.0))


def two_means_cosine(p: torch.Tensor, iters: int = 100) -> np.ndarray:
    """Spherical 2-means of the rows of ``p``: seeded with the two least similar rows (the first
    such pair), then Lloyd steps on cosine similarity until the labels settle. Deterministic."""
    pn = p.double().cpu()
    pn = pn / pn.norm(dim=1, keepdim=True).clamp_min(1e-30)
    sim = (pn @ pn.T).numpy()
    a, b = np.unravel_index(np.argmin(sim), sim.shape)
    centres = pn[[int(a), int(b)]]
    labels = None
    for _ in range(iters):
        new = np.argmax((pn @ centres.T).numpy(), axis=1).astype(np.int64)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        if len(np.unique(labels)) < 2:
            break
        centres = torch.stack([pn[torch.from_numpy(labels == j)].mean(0) for j in (0, 1)])
    return labels


@dataclass
class Tuning:
    labels: np.ndarray
    centroids: torch.Tensor
    merged: int
    split: int
    g: np.ndarray  # G_c of the clusters before tuning


def tune_clusters(x: torch.Tensor, proj: torch.Tensor, labels: np.ndarray, a: float, b: float,
                  cols: Optional[torch.Tensor] = None) -> Tuning:
    """One pass of Cluster Number Tuning (Algorithm 3) on the rows of ``x`` (full ω) with cluster
    ``labels`` (0..K−1, every cluster non-empty); ``proj`` holds the rows' projected vectors Mω_i
    (for the splits) and ``cols`` the coordinates the distances use (default: all)."""
    centroids, labels = m_step(x, labels)
    xs, cs = (x, centroids) if cols is None else (x[:, cols], centroids[:, cols])
    g = gc_ratios(xs, labels, cs)
    k = len(centroids)
    busy: set[int] = set()
    target = np.arange(k)
    merged = split = 0
    if k > 1:
        dist = torch.cdist(cs.double(), cs.double()).cpu().numpy()
        np.fill_diagonal(dist, np.inf)
        for j in sorted(range(k), key=lambda j: (g[j], j)):
            if not g[j] < a:
                break
            near = int(np.argmin(dist[j]))
            if j in busy or near in busy:
                continue
            busy |= {j, near}
            target[j] = near
            merged += 1
    out = target[labels]
    for j in range(k):
        members = np.flatnonzero(labels == j)
        if j in busy or not g[j] > b or len(members) < 2:
            continue
        halves = two_means_cosine(proj[_idx(members, proj.device)])
        if len(np.unique(halves)) < 2:
            continue
        out[members[halves == 1]] = k + split
        split += 1
    centroids, out = m_step(x, out)
    return Tuning(out, centroids, merged, split, g)


# ---------------------------------------------------------------------- the algorithm


class FedAC(Algorithm):
    name = "fedac"
    device_state_keys = ("omega0", "phi", "pca", "pca_mean")  # flat tensors kept with the centroids
    paper = "Zhang et al., FedAC: An Adaptive Clustered Federated Learning Framework for Heterogeneous Data, arXiv 2403.16460"
    hyperparameters = (
        replace(weighting("samples"), meaning="weights of the participants' embeddings in the global embedding Φ: "
                "samples (n_i) or uniform"),
        integer("k", 4, "initial number of clusters (Cluster Number Tuning changes it)", "K⁰", ge=1),
        real("mu", 0.01, "pull of ω_i towards its cluster centroid, (μ/2)‖ω_i − Ω_k*‖²", "μ", ge=0),
        real("lam", 0.01, "pull of the embedding φ_i towards the global embedding, (λ/2)‖φ_i − Φ‖²", "λ", ge=0),
        integer("components", None, "PCA components of LrCos (null: min(|S_t| − 1, 10))", "D", ge=1, optional=True),
        Hyper("center_before_project", False, "LrCos on M(ω − mean of the participants) instead of Mω "
              "(uncentred, scale-invariant)", "", "bool"),
        integer("pca_refresh_every", 1, "recompute the PCA map M every this many rounds, reusing it in between", ge=1),
        choice("lrcos_on", "model", ("model", "decision"), "the vectors of LrCos and CNT: all of ω, or only the "
               "decision layers h (cheaper)"),
        choice("e_step", "all", ("all", "participants"), "E-step over every client the server holds a model of, or "
               "over this round's participants only"),
        real("merge_threshold", 0.1, "CNT: a cluster with G_c below it merges into its nearest cluster", "a", ge=0),
        real("split_threshold", 1.0, "CNT: a cluster with G_c above it splits in two", "b", gt=0),
        integer("cnt_warmup", 0, "rounds without Cluster Number Tuning at the start (G_c means little while the "
                "models are still close to their common init)", ge=0),
        integer("cnt_every", 1, "run Cluster Number Tuning every this many rounds (after the warm-up)", ge=1),
        integer("decision_layers", None, "the last n Linear layers form the decision h, the rest the embedding φ "
                "(null: conv/BN layers are φ and the Linear layers h; without convs, the last Linear layer is h)",
                "", ge=1, optional=True),
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

    def projected(self, state: ServerState, ctx: RunContext, x: torch.Tensor) -> torch.Tensor:
        cols = self.cols(ctx)
        v = x if cols is None else x[:, cols]
        mean = state.algo["pca_mean"] if self.hp("center_before_project") and len(state.algo["pca"]) else None
        return project(v, state.algo["pca"], mean)

    def centroid_of_untrained(self, state: ServerState, ctx: RunContext) -> int:
        """The E-step for ω^0 (clients the server has no model of)."""
        lay = self.layout(ctx)
        cent = lay.flatten(state.models)
        w0 = self.projected(state, ctx, state.algo["omega0"][None])
        return int(e_step(lrcos(w0, self.projected(state, ctx, cent)))[0])

    # ------------------------------------------------------------------ state
    def init_state(self, ctx: RunContext) -> ServerState:
        lay = self.layout(ctx)
        n, k0 = ctx.num_clients, self.hp("k")
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
            phi = lay.unflatten(_scatter(lay, lay.embedding, state.algo["phi"], len(clients)))
            for n in lay.embedding:
                anchor[n] = (mu * anchor[n] + lam * phi[n]) / (mu + lam)
                prox[n] = mu + lam
        spec = LocalSpec(clients, init, t.lr, t.local_epochs, t.local_steps, t.batch_size, t.full_batch,
                         meta={"model_of_client": which}, client_epochs=self.local_work(ctx, clients, round))
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
        w = self.weights(result, np.arange(len(clients))).to(x_new.dtype).to(x_new.device)
        algo["phi"] = w @ x_new[:, phi_cols]
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
        # labels: R^0 before the first fit; afterwards every known client but this round's
        # first uploads (participants, so in every E-step's scope) has one
        labels = state.assignments[known].copy()
        proj = self.projected(new, ctx, x)
        if bool(algo["fitted"]):
            cent = lay.flatten(state.models)
        else:  # Ω_k^0 are all ω^0: fit them to R^0 first (k-means from a random partition)
            cent, labels = m_step(x, labels)
        scope = np.isin(known, clients) if a.e_step == "participants" else np.ones(len(known), bool)
        sim = lrcos(proj[_idx(np.flatnonzero(scope), proj.device)], self.projected(new, ctx, cent))
        labels[scope] = e_step(sim)
        due = state.round >= a.cnt_warmup and (state.round - a.cnt_warmup) % a.cnt_every == 0
        tuned = tune_clusters(x, proj, labels, a.merge_threshold if due else -np.inf, a.split_threshold if due else np.inf,
                              cols)
        assignments = np.full(ctx.num_clients, -1, np.int64)
        assignments[known] = tuned.labels
        algo["fitted"] = torch.tensor(True)
        models = {k: v.contiguous() for k, v in lay.unflatten(tuned.centroids).items()}
        new = new.replace(models=models, assignments=assignments, algo=algo)
        new.meta["fedac_gc"] = [float(g) for g in tuned.g]  # G_c of this round's clusters before tuning
        log_round(new, k_clusters=len(tuned.centroids), clusters_merged=tuned.merged, clusters_split=tuned.split)
        return new

    # ------------------------------------------------------------------ evaluation
    def eval_assignment(self, state: ServerState, ctx: RunContext) -> np.ndarray:
        return state.assignments

    def own_params(self, state: ServerState, ctx: RunContext, clients: np.ndarray) -> dict[str, torch.Tensor]:
        return self.layout(ctx).unflatten(self.omegas(state, clients))

    def evaluate(self, state: ServerState, ctx: RunContext) -> dict:
        from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

        seen, task = ctx.seen, ctx.data.task
        parts = [own_model_metrics(ctx.model, self.own_params(state, ctx, seen[i:i + 256]), ctx.data.test,
                                   seen[i:i + 256], task) for i in range(0, len(seen), 256)]
        c_loss, c_acc, n = (np.concatenate([p[j] for p in parts]) for j in range(3))
        out = summarise_clients(c_loss, c_acc, n, task)
        mine = state.assignments[seen]
        key, vals = ("accuracy", c_acc) if task == "classification" else ("loss", c_loss)
        for j in range(state.k):
            m = (mine == j) & (n > 0)
            out[f"cluster/{j}/clients"] = int((mine == j).sum())
            if m.any():
                out[f"cluster/{j}/{key}"] = float((vals[m] * n[m]).sum() / n[m].sum())
        has = mine >= 0
        if has.any():
            l_c, a_c, n_c = own_cluster_metrics(ctx.model, state.models, mine[has], ctx.data.test, seen[has], task)
            out.update({f"{k}_centroid": v for k, v in summarise_clients(l_c, a_c, n_c, task).items()
                        if k in ("accuracy", "loss")})
        out["num_clusters"] = state.k
        group = ctx.data.group[seen]
        if (group >= 0).all() and len(np.unique(group)) > 1:
            out["ari"] = float(adjusted_rand_score(group, mine))
            out["nmi"] = float(normalized_mutual_info_score(group, mine))
        out["_client_accuracy"] = c_acc if task == "classification" else None
        out["_client_loss"] = c_loss
        out["_assignment"] = state.assignments
        return out

    def finetune(self, state: ServerState, ctx: RunContext, clients: np.ndarray, assign: np.ndarray, round: int,
                 engine: str, stream: str) -> TrainResult:
        """Plain local SGD from each client's own ω_i; a client the server has no model of starts
        from the centroid it is given (a newcomer) or from ω^0."""
        from flockfl.engine import TRAINERS

        t, lay = self.cfg.train, self.layout(ctx)
        clients = np.asarray(clients, np.int64)
        x = self.omegas(state, clients).clone()
        assign = np.asarray(assign, np.int64)
        given = ~state.algo["omega"].written(clients) & (assign >= 0)
        if given.any():
            x[torch.from_numpy(given)] = lay.flatten(state.models)[torch.from_numpy(assign[given])]
        epochs = t.local_epochs if t.finetune_epochs is None else t.finetune_epochs
        spec = LocalSpec(clients, lay.unflatten(x), t.lr, epochs, None, t.batch_size, t.full_batch, stream=stream)
        return TRAINERS[engine](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round)

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


def _idx(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.int64)).to(device)


def _scatter(lay: Layout, names, flat_part: torch.Tensor, n: int) -> torch.Tensor:
    """A [n, dim] matrix holding ``flat_part`` (the listed parameters' coordinates) in every row."""
    full = torch.zeros(lay.dim, dtype=flat_part.dtype, device=flat_part.device)
    full[lay.columns(names).to(flat_part.device)] = flat_part
    return full[None].expand(n, -1)
