"""FlexCFL — Duan, Liu, Ji, Wu, Liang, Chen, Tan, "Flexible Clustered Federated Learning for
Client-Level Data Distribution Shift", IEEE TPDS 33(11) 2022 (spec ``flexcfl.md``; official code
morningD/FlexCFL). ``flexcfl`` with ``algorithm.migration=false`` is **FedGroup** (Duan et al.,
ISPA 2021), its static predecessor: EDC clustering, no client migration.

The server keeps m = ``algorithm.k`` group models, the initial model w_0 and every group's initial
optimisation direction Δw_0^(g). A client is in at most one group; a client in none is *cold*.

- **Group cold start** (``pre_federation``, §2.2, Alg. 3): min(α·m, N) random clients pre-train
  from w_0 (``pretrain_steps`` SGD steps, the code's 50) and upload Δw_0^(c) = w − w_0. The rows
  of ΔW are embedded by EDC (Eq. 7): M_d[i, k] = cos(Δw_i, v_k) for the m right singular vectors
  v_k of ΔW, computed exactly from the (αm × αm) Gram matrix ΔW ΔWᵀ = U Σ² Uᵀ as
  σ_k U_ik / ‖Δw_i‖ (no d_w × m matrix is formed; it equals the code's TruncatedSVD route up to
  each column's sign, which leaves every Euclidean distance and so the k-means partition
  unchanged: ``tests/test_flexcfl.py``). K-means++ (n_init=10, max_iter=20, random_state from
  (seed, "flexcfl/kmeans")) clusters the rows. Group j starts at the unweighted mean of its
  members' pre-trained models, with direction Δw_0^(g_j) = the mean of their updates; the
  clustered clients join their groups. ``group_init=madc``: MADC (Eq. 6) on the full cosine
  matrix, complete-linkage agglomerative clustering into m clusters (FedGroup's alternative).
  ``group_init=rcc`` (RCC ablation): m random clients pre-train, each one's model and update
  seed one group; only those m clients start assigned.
- **Client cold start** (Eq. 8, lazily): each round, every selected client in no group
  pre-trains from w_0 and joins ĝ = argmin_j (1 − cos(Δw_0^(g_j), Δw_pre))/2 against the fixed
  *initial* directions. ``cold_assign=random`` (RAC ablation): a uniformly random group
  ((seed, round, client, "flexcfl/rac")). Newcomers (``partition.unseen_fraction``) join the same way.
- **Migration** (§2.4, Eq. 9; ``migration=true``): before each round's training, every warm
  client's label counts are compared with its reference counts (those it was built with — the
  partitioned data — replaced only when a shift is detected, as the code). Detector
  ``shift_detector=code`` (default): W1 of the count vectors taken as C one-dimensional samples
  (``scipy.stats.wasserstein_distance(curr, prev)`` = mean |sort(curr) − sort(prev)|) >
  τ_i = ``tau_ratio``·n_i/C with n_i the client's partitioned training size; it cannot see a pure
  relabelling. ``label_aware``: W1 over the class indices between the two normalised label
  distributions > ``tau_ratio``. A client that fires redoes the client cold start on its new data
  (possibly the same group) and stores its new counts. Migration is local: no bytes.
- **Training**: FedAvg inside each group (``weighting=samples``: n_i over the group's selected
  members); a group with no selected member keeps its model.
- **Inter-group aggregation** (η_g = ``eta_g`` > 0), over all non-empty groups, each using the
  others' pre-aggregation models: ``inter_group_mode=normalized_avg`` (the code):
  w^j ← [w̃^j + Σ_{l≠j} (η_g/‖w̃^l‖) w̃^l] / [1 + Σ_{l≠j} η_g/‖w̃^l‖] (norms of the whole
  flattened model, float64); ``paper`` (Alg. 2 l.20, Eq. 20): w^j ← w̃^j + η_g Σ_{l≠j} w̃^l/‖w̃^l‖.
- **Auxiliary global model**: the unweighted mean of the non-empty groups' models, evaluated on
  every federating client as ``accuracy_global`` / ``loss_global`` (never trained).
- **Selection**: round-robin in client-id order (wrapping) for the first ⌈N/K⌉ rounds, so every
  client is cold-started by then (``round_robin``, the code), then K uniformly random clients.

Per round the history row gets ``clients_cold_started``, ``clients_shift_detected``,
``clients_migrated`` (detections that changed group), ``discrepancy`` (Eq. 3: the mean over the
trained clients of ‖w_i − w^(g_i)‖ against the group model after aggregation), ``bytes_inter_group``,
group sizes (``cluster/j/clients``), ``clients_warm`` and ``coverage`` (warm / federating clients).

Communication (spec §6.4, an inferred accounting that reproduces both of the paper's ratios, in
bytes of one model M): each round K·M down and K·M up (``bytes_down``/``bytes_up``, as FedAvg);
η_g > 0 adds m·M of server-side group exchange (``bytes_inter_group``, not in the per-client
bytes); the group cold start costs α·m·M up and α·m·M + N·m·M down (w_0 to the pre-training
clients, the m initial directions to every federating client; ``meta['pre_federation']``).
Cold start and migration pre-train locally and send nothing more.

Decisions on the spec's §8 (each explicit):

1. Inter-group formula: the code's normalised average is the default; the paper's is
   ``inter_group_mode=paper``.
2. Group initialisation: the code's — params = mean of the members' pre-trained params,
   direction = mean of their updates (not Alg. 2's w_0, not Alg. 3 l.16's mean of updates).
3. Pre-training length: ``pretrain_steps=50`` SGD steps (the code; epochs wrap with a reshuffle,
   a partial last batch is its own step); ``pretrain_steps=null`` runs one ClientUpdate of
   ``train.local_epochs`` epochs (the paper's reading). The batch orders come from their own
   streams ("flexcfl/pretrain", "flexcfl/cold_start", "flexcfl/newcomer"), never colliding with a
   round's training.
4. Shift detector: ``code`` (default, insensitive to which labels moved; n_i fixed at
   construction) or ``label_aware``.
5. Cold-start reference: always the fixed initial directions Δw_0^(g) (the code's ``redo=False``).
6. Test membership: current members. Every warm federating client is evaluated with its group's
   model (accuracy = total correct / total test samples of the warm clients); cold clients are not
   in ``accuracy`` until they are cold-started (``coverage`` < 1). The paper records no accuracy
   before every client is warm (round ⌈N/K⌉ with round-robin selection): its "max accuracy over
   rounds" is taken over the rounds with ``coverage == 1`` (``benchmarks/flexcfl_tables.py``).
   For the thesis's fine-tuned convention, a still-cold client starts from the auxiliary model.
7. Incremental shift: ``shift.mode`` (flockfl/stages/shift.py). The pre-trained clients built their
   reference counts on all their data, so the first release (1/4) fires the code detector for
   every warm client at round 0 and they redo the cold start on their released data, as in the code.
8. (IFCA/FeSEM) see ``fesem.py``: simple average by default, ``legacy_first_update_only``.
9–13. Data and table matters: ``benchmarks/flexcfl_tables.py``.
14. Communication unit: as above (bytes, with the §6.4 model-unit accounting).
15. sklearn: ``KMeans(init="k-means++", n_init=10, max_iter=kmeans_max_iter)``, random_state
    drawn from (seed, "flexcfl/kmeans"); the Gram-matrix EDC needs no randomized SVD.
16. Keras L2 kernel regulariser and Glorot init: not modelled (PyTorch default init, plain SGD).
17. Swap-part early return: ``shift.mode=code_faithful`` (flockfl/stages/shift.py).

Code-only extras (temperature reassignment and aggregation, periodic re-clustering) are not
implemented (the spec: leave them disabled). The label-count detector needs class labels: with a
regression task migration never fires.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl import clustering
from flockfl.algorithms.grouped import GroupedClients, from_row, rows64, shift_hypers, with_round_log
from flockfl.algorithms.hyper import Hyper, choice, integer, real, sourced_each, weighting
from flockfl.client import train_from
from flockfl.algorithms.auto import recorded
from flockfl.algorithms.hyper import is_auto
from flockfl.clustering.choose import Choice, choose_cut, choose_kmeans, cosine_distance
from flockfl.clustering.groups import eq8_assign, inter_group, kmeans_partition, madc_matrix
from flockfl.context import RunContext
from flockfl.eval_protocol import family, protocol
from flockfl.evaluation import measure_shared
from flockfl.rng import np_rng
from flockfl.state import ServerState


class FlexCFL(GroupedClients):
    name = "flexcfl"
    paper = ("Duan et al., FlexCFL: Flexible Clustered Federated Learning for Client-Level Data Distribution Shift, "
             "IEEE TPDS 33(11) 2022 (migration=false: FedGroup)")
    hyperparameters = (
        weighting("samples", source="paper", note="Alg. 2: FedAvg (n_i) inside each group"),
        integer("k", 3, "number of groups; auto: every federating client pre-trains and m is the group cold start's "
                "k (EDC + k-means; MADC + complete linkage) with the best silhouette, one group if none clears 0.25 "
                "(flockfl.clustering.choose; 'FlexCFL + auto m' in tables)", "m", ge=1, auto=True, source="paper",
                note="m = 3 on MNIST (Fig. 3); 5 on FEMNIST and FashionMNIST (Fig. 4) and on Synthetic (code)"),
        integer("alpha", 20, "pre-training scale: min(α·m, N) clients pre-train for the group cold start", "α", ge=1,
                source="paper", note="§5.1: α = 20"),
        Hyper("pretrain_steps", 50, "SGD steps of every pre-training from w_0 (the code; null: one ClientUpdate of "
              "train.local_epochs epochs, the paper)", "", "int", ge=1, optional=True, source="code",
              note="pretrain(init_params, iterations=50); the paper's Alg. 3 calls ClientUpdate"),
        choice("group_init", "edc", ("edc", "madc", "rcc"),
               "group cold start: EDC + k-means++ (FlexCFL), MADC + complete linkage (FedGroup's alternative), or "
               "m random clients as centers (RCC ablation)", source="paper", note="Alg. 3, Eq. 7"),
        choice("cold_assign", "eq8", ("eq8", "random"),
               "cold clients join the group of Eq. 8 (least cosine dissimilarity to its initial direction) or a "
               "random group (RAC ablation)", source="paper", note="Eq. 8"),
        *sourced_each(shift_hypers(True), {
            "migration": ("paper", "§3.4: clients migrate under distribution shift (false is FedGroup)"),
            "shift_detector": ("code", "Client.check_distribution_shift: W1 of the label-count vectors"),
            "tau_ratio": ("paper", "Eq. 9: τ_i = 0.2·n_i / LabelSize"),
            "round_robin": ("code", "round-robin in id order for the first ⌈N/K⌉ rounds (§5.6)")}),
        real("eta_g", 0.0, "inter-group learning rate (0: independent groups)", "η_g", ge=0, source="paper",
             note="plain FlexCFL; FlexCFL-η_g uses 0.1 (Table III) and 5.0 (Table IV)"),
        choice("inter_group_mode", "normalized_avg", ("normalized_avg", "paper"),
               "inter-group aggregation: the code's normalised convex combination or the paper's Eq. 20",
               source="code", note="the paper's Eq. 20 is not scale-preserving (spec §2.6)"),
        integer("kmeans_max_iter", 20, "k-means iterations per run (the code)", ge=1, source="code",
                note="KMeans(m, max_iter=20)"),
    )

    # ------------------------------------------------------------------ state
    def init_models(self, ctx):
        w0 = self.w0(ctx)
        return {k: v.unsqueeze(0).expand(self.num_models, *v.shape).clone() for k, v in w0.items()}

    def init_state(self, ctx):
        state = super().init_state(ctx)
        w0 = self.w0(ctx)
        return state.replace(algo={**state.algo, "w0": w0, "global": {k: v.clone() for k, v in w0.items()}})

    def pretrain(self, state, ctx, clients, round, stream) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """(pre-trained params, their updates Δw = w − w_0 as float64 rows)."""
        steps = self.cfg.algorithm.pretrain_steps
        params = train_from(ctx, state.algo["w0"], clients, epochs=self.cfg.train.local_epochs if steps is None else 1,
                            steps=steps, round=round, stream=stream).params
        w0 = rows64({k: v.unsqueeze(0) for k, v in state.algo["w0"].items()})
        return params, rows64(params) - w0

    # ------------------------------------------------------------------ group cold start
    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if is_auto(cfg.algorithm.k) and cfg.algorithm.group_init == "rcc":
            raise ValueError("algorithm.k: auto reads m from the pre-training updates' clustering, and group_init=rcc "
                             "makes none (m random centres); use group_init=edc or madc, or a number of groups")

    def auto_groups(self, delta: np.ndarray, seed: int) -> Choice:
        """k=auto: the group cold start's own clustering at each m (EDC + k-means, or the cuts of
        MADC's complete-linkage dendrogram), scored on the cosine distances of the updates (what
        EDC approximates and MADC is computed from: MADC itself, a distance between rows of
        cosines, shows a 0.38 silhouette on IID clients)."""
        a = self.cfg.algorithm
        if a.group_init == "madc":
            return choose_cut(madc_matrix(delta), "complete", score_on=cosine_distance(delta))
        rs = int(np_rng(seed, purpose="flexcfl/kmeans").integers(2**31 - 1))
        return choose_kmeans(delta, rs, dist=cosine_distance(delta), partition=lambda rows, k: kmeans_partition(
            clustering.edc_embedding(delta[rows], k), k, rs, a.kmeans_max_iter))

    def pre_federation(self, state: ServerState, ctx: RunContext) -> ServerState:
        a = self.cfg.algorithm
        auto_m = is_auto(a.k)
        m = None if auto_m else a.k
        rng = np_rng(ctx.seed, purpose="flexcfl/pretrain_clients")
        # k=auto: m is unknown, so every federating client pre-trains (the evidence of the choice)
        count = len(ctx.seen) if auto_m else min(m if a.group_init == "rcc" else a.alpha * m, len(ctx.seen))
        chosen = np.sort(rng.choice(ctx.seen, size=count, replace=False)).astype(np.int64)
        params, delta = self.pretrain(state, ctx, chosen, -1, "flexcfl/pretrain")
        if auto_m:
            choice = self.auto_groups(delta, ctx.seed)
            m, labels = choice.k, choice.labels
            state = recorded(state, choice, "algorithm.k", self.name, -1, log=False, group_init=a.group_init)
        elif a.group_init == "rcc":
            labels = np.arange(count, dtype=np.int64)
        elif a.group_init == "madc":
            labels = (clustering.hierarchical_clusters(madc_matrix(delta), n_clusters=min(m, count), linkage="complete")
                      if count > 2 else np.arange(count, dtype=np.int64))
        else:
            rs = int(np_rng(ctx.seed, purpose="flexcfl/kmeans").integers(2**31 - 1))
            labels = kmeans_partition(clustering.edc_embedding(delta, m), m, rs, a.kmeans_max_iter)
        flat_params = rows64(params)
        like = state.algo["w0"]
        w0_flat = rows64({k: v.unsqueeze(0) for k, v in like.items()})[0]
        rows, dirs = [], np.zeros((m, delta.shape[1]))
        for j in range(m):
            members = labels == j
            if members.any():
                rows.append(flat_params[members].mean(0))
                dirs[j] = delta[members].mean(0)
            else:  # an empty group (fewer pre-training clients than groups) starts at w_0 with no direction
                rows.append(w0_flat)
        groups = [from_row(r, like) for r in rows]
        models = {k: torch.stack([g[k] for g in groups]) for k in like}
        assignments = state.assignments.copy()
        assignments[chosen] = labels
        nonempty = np.unique(labels)
        glob = from_row(np.stack(rows)[nonempty].mean(0), like)
        algo = {**state.algo, "directions": torch.from_numpy(dirs), "global": glob,
                "pretrain_clients": torch.from_numpy(chosen), "pretrain_labels": torch.from_numpy(labels)}
        state = state.replace(models=models, assignments=assignments, algo=algo)
        per_model = self.model_bytes(state)
        return state.replace(meta={**state.meta, "pre_federation_bytes": {
            "up": count * per_model, "down": count * per_model + len(ctx.seen) * m * per_model}})

    # ------------------------------------------------------------------ client cold start and migration
    def cold_groups(self, state, ctx, clients: np.ndarray, round: int, stream: str) -> np.ndarray:
        """The group each listed client joins: Eq. 8 after pre-training from w_0, or random (RAC)."""
        if len(clients) == 0:
            return np.zeros(0, np.int64)
        if self.cfg.algorithm.cold_assign == "random":
            return np.array([np_rng(ctx.seed, round, int(c), "flexcfl/rac").integers(state.k) for c in clients], np.int64)
        return self.pretrained_groups(state, ctx, clients, round, stream)[0]

    def pretrained_groups(self, state, ctx, clients: np.ndarray, round: int, stream: str):
        """Eq. 8 after pre-training from w_0: (each client's group, the pre-trained models, the updates)."""
        params, delta = self.pretrain(state, ctx, clients, round, stream)
        return eq8_assign(delta, state.algo["directions"].numpy())[0], params, delta

    def before_training(self, state, ctx, clients, round):
        """Migration over every warm client (§2.4), then the cold start of the selected cold ones."""
        moving, counts = self.shifted_clients(state, ctx)
        cold = np.asarray([c for c in clients if state.assignments[c] < 0], np.int64)
        todo = np.concatenate([moving, cold]).astype(np.int64)
        order = np.argsort(todo, kind="stable")
        groups = np.empty(len(todo), np.int64)
        if is_auto(self.cfg.algorithm.k) and len(moving) and self.cfg.algorithm.cold_assign == "eq8":
            groups[order], params, delta = self.pretrained_groups(state, ctx, todo[order], round, "flexcfl/cold_start")
            back = np.empty(len(todo), np.int64)
            back[order] = np.arange(len(todo))
            state, groups[: len(moving)] = self.redecide(state, ctx, moving, groups[: len(moving)],
                                                         {k: v[back[: len(moving)]] for k, v in params.items()},
                                                         delta[back[: len(moving)]], round)
        else:
            groups[order] = self.cold_groups(state, ctx, todo[order], round, "flexcfl/cold_start")
        assignments = state.assignments.copy()
        migrated = int((assignments[moving] != groups[: len(moving)]).sum())
        assignments[todo] = groups
        algo = self.store_counts(state, moving, counts)
        state = state.replace(assignments=assignments, algo=algo)
        return with_round_log(state, clients_cold_started=len(cold), clients_shift_detected=len(moving),
                              clients_migrated=migrated)

    def redecide(self, state, ctx, moving: np.ndarray, eq8: np.ndarray, params: dict, delta: np.ndarray, round: int):
        """k=auto when the shift detector fires: is m still right? The shifted clients' fresh
        pre-training updates are clustered together with the groups' directions (the same
        criterion as the cold start, on cosine distances); a cluster of shifted clients that holds
        no group's direction is a distribution no group has, so it becomes a new group (model: its
        members' mean pre-trained model; direction: their mean update). The other shifted clients
        join by Eq. 8 as before. Returns (state, each shifted client's group)."""
        dirs = state.algo["directions"].numpy()
        anchors = np.flatnonzero(np.linalg.norm(dirs, axis=1) > 0)
        rows = np.concatenate([dirs[anchors], delta])
        rs = int(np_rng(ctx.seed, round, purpose="flexcfl/redecide").integers(2**31 - 1))
        choice = choose_kmeans(rows, rs, dist=cosine_distance(rows))
        labels = choice.labels
        own = labels[len(anchors):]
        out, born = eq8.copy(), []
        for c in np.unique(own):
            if (labels[: len(anchors)] == c).any():
                continue
            members = np.flatnonzero(own == c)
            out[members] = state.k + len(born)
            born.append(members)
        if born:
            like = state.algo["w0"]
            flat = rows64(params)
            models = {k: torch.cat([v] + [from_row(flat[m].mean(0), like)[k].unsqueeze(0) for m in born])
                      for k, v in state.models.items()}
            dirs = np.concatenate([dirs] + [delta[m].mean(0, keepdims=True) for m in born])
            state = state.replace(models=models, algo={**state.algo, "directions": torch.from_numpy(dirs)})
        state = recorded(state, choice, "algorithm.k", self.name, round, shifted_clients=len(moving),
                         groups_born=len(born), groups=int(state.k))
        return state, out

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, state, ctx, spec, result, assign):
        a = self.cfg.algorithm
        new = super().aggregate(state, ctx, spec, result, assign)  # FedAvg inside each group
        like = state.algo["w0"]
        flat = rows64(new.models)
        nonempty = np.unique(new.assignments[new.assignments >= 0])
        extra = 0
        if a.eta_g > 0 and len(nonempty) > 1:
            flat[nonempty] = inter_group(flat[nonempty], a.eta_g, a.inter_group_mode)
            groups = [from_row(r, like) for r in flat]
            new = new.replace(models={k: torch.stack([g[k] for g in groups]) for k in like})
            extra = len(nonempty) * self.model_bytes(state)
        glob = from_row(flat[nonempty].mean(0), like) if len(nonempty) else state.algo["global"]
        trained = rows64(result.params)
        disc = float(np.linalg.norm(trained - flat[assign], axis=1).mean()) if len(assign) else 0.0
        new = new.replace(algo={**new.algo, "global": glob})
        return with_round_log(new, discrepancy=disc, bytes_inter_group=extra)

    # ------------------------------------------------------------------ evaluation
    def fallback_model(self, state, ctx):
        return state.algo["global"]

    def evaluate(self, state, ctx):
        """Groups as the base; ``accuracy_global``/``loss_global``: every client with the global model."""
        out = super().evaluate(state, ctx)
        one = {k: v.unsqueeze(0) for k, v in state.algo["global"].items()}
        cm = measure_shared(ctx, one, np.zeros(len(ctx.seen), np.int64), ctx.seen)
        out.update(family(cm, protocol(ctx), ctx.data.task, "_global", keys=("accuracy_global", "loss_global")))
        return out

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer is cold-started like any cold client (Eq. 8, or random with RAC)."""
        groups = self.cold_groups(state, ctx, np.asarray(newcomers, np.int64), state.round, "flexcfl/newcomer")
        rule = "Eq. 8 cold start" if self.cfg.algorithm.cold_assign == "eq8" else "a random group (RAC)"
        return state, groups, rule

