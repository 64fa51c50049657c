"""FeSEM — Long, Xie, Shen, Zhou, Wang, Jiang, "Multi-center federated learning: clients
clustering for better personalization" (World Wide Web 2023; arXiv 2005.01026), as the FlexCFL
paper runs it as a baseline (spec ``flexcfl.md`` §4; official FlexCFL code ``trainer/fesem.py``).

Stochastic EM over ℓ2 distances with m = ``algorithm.k`` centers:

- the centers start as m independent random models ((seed, j, "fesem/center")); every client's
  *last local solution* starts as the global initial model w_0 ((seed, 0, "init"), FedAvg's);
- E-step, each round before training: every selected client joins the center nearest (ℓ2, ties →
  the lowest index) to its last local solution — w_0 for a client that never trained, so
  never-trained clients all go to the center nearest w_0 (the distance-concentration weakness the
  FlexCFL paper points out);
- M-step: each center becomes the **simple average** of the models its selected members return
  (``weighting=uniform``; ``samples`` gives FedAvg weights). ``legacy_first_update_only=true``
  reproduces the official code's bug (spec §8 item 8: ``federated_averaging_aggregate(updates,
  [1.0*len(nks)])`` zips a one-element weight list, so a center takes only its *first* selected
  member's model; our cohort order is ascending client id). A center nobody chose keeps its model;
- FeSEM-MIG (``migration=true``, Fig. 6): the FlexCFL shift detector (Eq. 9, see ``flexcfl.py``)
  runs over every warm client and a client that fires is re-assigned by the same ℓ2 criterion
  (which ignores the data, so it rarely changes anything — as the paper observes);
- selection, swaps and evaluation follow FlexCFL's code (``GroupedClients``): round-robin for the
  first ⌈N/K⌉ rounds, swaps only between warm clients, each warm client evaluated with its
  current center; a newcomer (never trained) joins the center nearest w_0.

Memory: the last local solution of every client is kept in ``state.algo['last_local']``, a
:class:`~flockfl.clientstate.ClientTable` (a client never trained reads w_0), as the server needs
it for the E-step; a round reads and writes only the clients it touches. Communication is FedAvg's (one model
down and one up per selected client); the distances are computed on the server.
"""

from __future__ import annotations

import numpy as np

from flockfl.algorithms.grouped import GroupedClients, rows64, shift_hypers, with_round_log
from flockfl.algorithms.hyper import Hyper, integer, sourced_each, weighting
from flockfl.clientstate import ClientTable
from flockfl.clustering.groups import nearest_centers
from flockfl.engine.functional import stack
from flockfl.rng import torch_generator
from models import init_params


class FeSEM(GroupedClients):
    name = "fesem"
    paper = "Long et al., Multi-center federated learning (FeSEM), World Wide Web 2023 (arXiv 2005.01026)"
    hyperparameters = (
        weighting("uniform", source="paper", note="a center is the simple average of its members (FlexCFL §4)"),
        integer("k", 3, "number of centers", "K", ge=1, source="paper",
                note="FlexCFL's tables run it with their m: 3 on MNIST, 5 on the other data"),
        Hyper("legacy_first_update_only", False, "the official FlexCFL code's bug: a center takes only its first "
              "selected member's model instead of the simple average", "", "bool", source="paper",
              note="the simple average as described; true reproduces the FlexCFL code, whose published numbers "
                   "probably include the bug (spec §8 item 8)"),
        # FeSEM-MIG's keys: FlexCFL's shift machinery, as the FlexCFL paper and code run FeSEM
        *sourced_each(shift_hypers(False), {
            "migration": ("paper", "FeSEM has no shift detection; true is FlexCFL's FeSEM-MIG (Fig. 6)"),
            "shift_detector": ("code", "FlexCFL's detector, as FeSEM-MIG uses it"),
            "tau_ratio": ("paper", "FlexCFL's Eq. 9, as FeSEM-MIG uses it"),
            "round_robin": ("code", "FlexCFL's code selects every method's clients so (§5.6)")}),
    )

    def init_models(self, ctx):
        return stack([init_params(ctx.model, torch_generator(ctx.seed, client=j, purpose="fesem/center"))
                      for j in range(self.num_models)])

    def init_state(self, ctx):
        state = super().init_state(ctx)
        w0 = self.w0(ctx)
        return state.replace(algo={**state.algo, "w0": w0, "last_local": ClientTable(ctx.num_clients, w0)})

    def nearest(self, state, clients: np.ndarray) -> np.ndarray:
        if len(clients) == 0:
            return np.zeros(0, np.int64)
        points = rows64(state.algo["last_local"].gather(clients, next(iter(state.models.values())).device))
        return nearest_centers(points, rows64(state.models))

    def before_training(self, state, ctx, clients, round):
        """FeSEM-MIG's re-assignment of shifted warm clients, then the E-step of the selected ones."""
        moving, counts = self.shifted_clients(state, ctx)
        todo = np.union1d(moving, clients).astype(np.int64)
        groups = self.nearest(state, todo)
        before = state.assignments[todo]
        assignments = state.assignments.copy()
        assignments[todo] = groups
        in_moving = np.isin(todo, moving)
        state = state.replace(assignments=assignments, algo=self.store_counts(state, moving, counts))
        return with_round_log(state, clients_cold_started=int((before < 0).sum()), clients_shift_detected=len(moving),
                              clients_migrated=int(((before != groups) & in_moving).sum()),
                              clients_reassigned=int(((before != groups) & (before >= 0)).sum()))

    def aggregate(self, state, ctx, spec, result, assign):
        if self.cfg.algorithm.legacy_first_update_only:
            models = {k: v.clone() for k, v in state.models.items()}
            for j in range(state.k):
                members = np.flatnonzero(assign == j)
                if len(members):
                    for k in models:
                        models[k][j] = result.params[k][int(members[0])]
            new = self._with_assignments(state, models, result.clients, assign)
        else:
            new = super().aggregate(state, ctx, spec, result, assign)
        return new.replace(algo={**new.algo, "last_local": state.algo["last_local"].scatter(result.clients, result.params)})

    def fallback_model(self, state, ctx):
        j = int(nearest_centers(rows64({k: v.unsqueeze(0) for k, v in state.algo["w0"].items()}),
                                rows64(state.models))[0])
        return {k: v[j] for k, v in state.models.items()}

    def admit_newcomers(self, state, ctx, newcomers):
        """A newcomer never trained: its local solution is w_0, so it joins the center nearest w_0."""
        w0 = rows64({k: v.unsqueeze(0) for k, v in state.algo["w0"].items()})
        j = int(nearest_centers(w0, rows64(state.models))[0])
        return state, np.full(len(newcomers), j, np.int64), "the center nearest w_0 (ℓ2)"
