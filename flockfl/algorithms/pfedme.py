"""pFedMe — Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, https://arxiv.org/abs/2006.08848 (code CharlieDinh/pFedMe).

F_i(w) = min_θ {f_i(θ) + (λ/2)‖θ − w‖²}. A selected client starts from w_{i,0} = w_t and, for each
batch D of its round batch order (stream ``shuffle``, E epochs: PFLlib's R = every batch):

- θ̃ ≈ argmin_θ f_i(θ; D) + (λ/2)‖θ − w_{i,r}‖²: K (``inner_steps``) GD steps at η_p
  (``personal_lr``) on that one batch, warm-started from the previous θ̃ (θ = w_t at the start);
- w_{i,r+1} = w_{i,r} − ηλ(w_{i,r} − θ̃)  (η = ``train.lr``).

Server: w_{t+1} = (1 − β)w_t + β·Σ p_i w_{i,R} over the cohort (sample-weighted, the official
code). Only the sampled clients train (PFLlib, FL-bench; the paper has all N train but only
aggregates S_t, which changes nothing but the unsampled θ̃). No inner μθ term (the paper's;
the codes add μ = 1e-3). β = 0 freezes w.

The inner solve has two nested loops, which LocalSpec cannot express: a per-client plain
PyTorch loop runs in ``local_spec`` and the round's ``solver`` returns its w_{i,R}, so both
trainers agree trivially. ``train.momentum`` is ignored (plain GD/SGD, as the paper).

State: θ̃_i (a detached copy after the last inner solve, never aliased with w_{i,R}) in a
:class:`~flockfl.clientstate.ClientTable` (``state.algo['personal']``), cohort rows only; a
client never seen uses the current w. Bytes: 2|w|. Evaluation: ``accuracy`` (=
``accuracy_personal``) is θ̃_i (pFedMe-PM), ``accuracy_global`` is w (pFedMe-GM).
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.aggregation import weighted_mean
from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import integer, real, weighting
from flockfl.algorithms.personal import PersonalModels, gradient, trained_names
from flockfl.engine.schedule import client_batches
from flockfl.rng import np_rng


def moreau_pass(model, spec, data, task, seed: int, round: int, lam: float, k_steps: int, p_lr: float):
    """(w_{i,R}, θ̃_i) of every client of ``spec`` (see the module doc)."""
    names = trained_names(model, spec.init)
    out_w = {k: v.detach().clone() for k, v in spec.init.items()}
    out_t = {k: v.detach().clone() for k, v in spec.init.items()}
    lr = float(spec.lr)

    grad_at = gradient(model, names, task)

    for i, cid in enumerate(spec.clients):
        x_c, y_c = data.client(int(cid))
        w = {k: out_w[k][i] for k in out_w}
        theta = dict(w)
        for b in client_batches(len(x_c), spec, np_rng(seed, round, int(cid), spec.stream), i):
            xb, yb = x_c[torch.as_tensor(b, device=x_c.device)], y_c[torch.as_tensor(b, device=y_c.device)]
            for _ in range(k_steps):
                g = grad_at(theta, xb, yb)
                theta = {k: theta[k] - p_lr * (g[k] + lam * (theta[k] - w[k])) if k in g else w[k] for k in w}
            w = {k: w[k] - lr * lam * (w[k] - theta[k]) if k in names else w[k] for k in w}
        for k in out_w:
            out_w[k][i] = w[k]
            out_t[k][i] = theta[k].detach().clone()
    return out_w, out_t


def precomputed(model, spec, data, task):
    """The round's ``solver``: the w_{i,R} that ``local_spec``'s loop computed."""
    return {k: v.clone() for k, v in spec.meta["pfedme_w"].items()}


class PFedMe(PersonalModels):
    name = "pfedme"
    paper = "Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, NeurIPS 2020, arXiv 2006.08848"
    hyperparameters = (
        weighting("samples", source="code", note="CharlieDinh/pFedMe: the sampled clients' w_{i,R} weighted "
                                                 "n_i/Σ_S n"),
        real("lam", 15.0, "Moreau-envelope regularisation pulling θ towards w (default 15: the official MNIST "
             "comparison)", "λ", gt=0, source="code", note="CharlieDinh/pFedMe README, MNIST comparison: λ = 15"),
        integer("inner_steps", 5, "GD steps of the inner personal solve, on one batch (default 5: the official code)",
                "K", ge=1, source="code", note="CharlieDinh/pFedMe README, main.py: K = 5"),
        real("personal_lr", 0.09, "step size of the inner solve (default 0.09: the official MNIST DNN run)", "η_p",
             gt=0, source="code", note="CharlieDinh/pFedMe README, MNIST comparison: η_p = 0.09 for the DNN (0.1 for MLR)"),
        real("beta", 1.0, "server mixing w ← (1−β)w + β·mean w_i (default 1: the official MNIST comparison; "
             "0 freezes w, > 1 accelerates)", "β", ge=0, source="code",
             note="CharlieDinh/pFedMe README, MNIST comparison: β = 1 (PFLlib's -bt defaults to 0)"),
    )
    def local_spec(self, state, ctx, clients, round):
        spec = Algorithm.local_spec(self, state, ctx, clients, round)
        w, theta = moreau_pass(ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round, float(self.hp("lam")),
                               int(self.hp("inner_steps")), float(self.hp("personal_lr")))
        spec.meta = {**spec.meta, "pfedme_w": w, "personal": theta}
        spec.solver = precomputed
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        """w ← (1 − β)w + β·Σ p_i w_{i,R}; θ̃ of the trained clients to their rows."""
        beta = float(self.hp("beta"))
        mean = weighted_mean(result.params, self.weights(result, np.arange(len(result.clients))))
        models = {k: ((1 - beta) * v[0] + beta * mean[k]).unsqueeze(0) for k, v in state.models.items()}
        return self.keep_rows(self._with_assignments(state, models, result.clients, assign), state, spec, result)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global w"
