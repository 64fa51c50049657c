"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, https://arxiv.org/abs/2012.04221 (code litian96/ditto).

The global model w is plain FedAvg. Each selected client k also keeps a personal model v_k
and, each round it is selected, takes ``personal_epochs`` epochs of

    v_k ← v_k − η(∇F_k(v_k; b) + λ(v_k − w^t)),

anchored to the round-start global w^t: LocalSpec's proximal term (``prox_mu`` = λ,
``prox_anchor`` = w^t), so both trainers run it. The personal pass uses the round's batch
order (stream ``shuffle``: the official code's v- and w-steps share each batch) and runs
*sequentially* before the global pass (PFLlib, FL-bench; the official code interleaves them
step by step, which gives the same v when the two passes do not interact: they do not, v
never feeds w). ``train.momentum`` applies to both passes. λ = 0 is local training; λ → ∞
gives v_k = w^t.

State: v_k in a :class:`~flockfl.clientstate.ClientTable` (``state.algo['personal']``); only
the cohort's rows are read and written. A client never seen starts from the current global w
(its row is unwritten). v_k never travels: bytes are FedAvg's 2|w|.

Evaluation: ``accuracy`` (= ``accuracy_personal``) is each client's v_k; ``accuracy_global``
is w. Newcomers (and ``train.eval_finetune``) train a personal model from the global w with
the same proximal term.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import integer, real, weighting
from flockfl.aggregation import broadcast
from flockfl.algorithms.personal import PersonalModels, run_pass
from flockfl.client import finetune_epochs, pass_spec
from flockfl.engine import TRAINERS


class Ditto(PersonalModels):
    name = "ditto"
    paper = "Li et al., Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021, arXiv 2012.04221"
    hyperparameters = (
        weighting("samples"),
        real("lam", 1.0, "proximal weight pulling each personal model v_k towards the global w (default 1: the "
             "official code's FMNIST script and FL-bench; 0 = local training)", "λ", ge=0),
        integer("personal_epochs", None, "local epochs on v_k per selected round (default null = train.local_epochs, "
                "as PFLlib and FL-bench: one pass beside each global pass)", "s", ge=0, optional=True),
    )
    def epochs(self) -> int:
        e: Optional[int] = self.hp("personal_epochs")
        return self.cfg.train.local_epochs if e is None else int(e)

    def personal_spec(self, state, ctx, clients, init, epochs: int, stream: str):
        t = self.cfg.train
        return pass_spec(t, clients, init, epochs, stream=stream, momentum=t.momentum,
                         prox_mu=float(self.hp("lam")), prox_anchor=broadcast(state.models, len(clients)))

    # ------------------------------------------------------------------ round
    def local_spec(self, state, ctx, clients, round):
        """FedAvg's spec for w; the personal pass on v_k runs here, its result rides in ``meta``."""
        spec = Algorithm.local_spec(self, state, ctx, clients, round)
        v = self.own_models(state, ctx, clients, None)
        if self.epochs():
            v = run_pass(ctx, state, self.personal_spec(state, ctx, clients, v, self.epochs(), "shuffle"), round).params
        spec.meta = {**spec.meta, "personal": {k: x.contiguous() for k, x in v.items()}}
        return spec

    def finetune(self, state, ctx, clients, assign, round, engine, stream):
        """``train.finetune_epochs`` personal epochs (the proximal step) from each client's v_k
        (from w for a newcomer)."""
        clients = np.asarray(clients, np.int64)
        init = self.own_models(state, ctx, clients, assign)
        spec = self.personal_spec(state, ctx, clients, init, finetune_epochs(self.cfg.train), stream)
        return TRAINERS[engine](ctx.model, spec, ctx.data.train, ctx.data.task, ctx.seed, round)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "a personal model trained from the global w (λ-prox)"
