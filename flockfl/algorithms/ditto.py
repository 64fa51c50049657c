"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, https://arxiv.org/abs/2012.04221 (code litian96/ditto).

The global model w is plain FedAvg. Each selected client k also keeps a personal model v_k
and, each round it is selected, takes ``personal_epochs`` epochs of

    v_k ← v_k − η(∇F_k(v_k; b) + λ(v_k − w^t)),

anchored to the round-start global w^t: LocalSpec's proximal term (``prox_mu`` = λ,
``prox_anchor`` = w^t), so both trainers run it. ``schedule`` says which batches:

- ``interleaved`` (default, the official code litian96/ditto): one v-step beside each w-step on
  the same mini-batch. v never feeds w and w^t is fixed during the round, so running the v-steps
  as one pass over the round's batch order (stream ``shuffle``) before the global pass gives
  exactly the interleaved result; ``personal_epochs`` must then equal the global pass's epochs.
- ``sequential`` (PFLlib, FL-bench): ``personal_epochs`` epochs on v with their own batch
  order (stream ``personal``), then the global pass.

``train.momentum`` applies to both passes. λ = 0 is local training; λ → ∞ gives v_k = w^t.

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
from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.aggregation import broadcast
from flockfl.algorithms.personal import PersonalModels
from flockfl.client import finetune_epochs, pass_spec
from flockfl.engine import TRAINERS


PERSONAL_SPEC = "ditto_personal_spec"  # spec.meta: the v-pass of the shard's clients


def ditto_pass(model, spec, data, task, engine, seed, round):
    """The shard's v-pass (``LocalSpec.personal_pass``): λ-proximal SGD from each client's v_k,
    anchored to w^t, by the shard's trainer; its clients are the shard's."""
    return TRAINERS[engine](model, spec.meta[PERSONAL_SPEC], data, task, seed, round).params


class Ditto(PersonalModels):
    name = "ditto"
    paper = "Li et al., Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021, arXiv 2012.04221"
    hyperparameters = (
        weighting("samples", source="library", note="FedAvg's n_i weights, as TsingZ0/PFLlib and KarhouTam/FL-bench; "
                                                    "the official litian96/ditto samples clients ∝ n_k and adds the "
                                                    "uniform mean of Δw"),
        real("lam", 1.0, "proximal weight pulling each personal model v_k towards the global w (default 1: the "
             "official code's FMNIST script and FL-bench; 0 = local training)", "λ", ge=0, source="code",
             note="litian96/ditto run_fashion_clean_ditto_lam1.sh: λ = 1 (main.py default 0; FL-bench 1)"),
        integer("personal_epochs", None, "local epochs on v_k per selected round (default null = train.local_epochs, "
                "as PFLlib and FL-bench: one pass beside each global pass)", "s", ge=0, optional=True, source="code",
                note="litian96/ditto ditto.py: one v-step beside each of the local w-steps (PFLlib, FL-bench: 1 "
                     "personal epoch beside 1 global)"),
        choice("schedule", "interleaved", ("interleaved", "sequential"), "interleaved: a v-step beside each w-step on "
               "the same batch (the official code); sequential: the personal epochs on their own batch order, then the "
               "global ones (PFLlib, FL-bench)", source="code",
               note="litian96/ditto flearn/trainers_MTL/ditto.py: per minibatch one step on v, then one on w"),
    )

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        a, t = cfg.algorithm, cfg.train
        e = getattr(a, "personal_epochs", None)
        if getattr(a, "schedule", "interleaved") == "interleaved" and e is not None and e != t.local_epochs:
            raise ValueError(f"algorithm.personal_epochs: {e} personal epochs cannot interleave with "
                             f"train.local_epochs={t.local_epochs} (one v-step beside each w-step); leave it unset "
                             "or set algorithm.schedule=sequential")

    def epochs(self) -> int:
        e: Optional[int] = self.hp("personal_epochs")
        return self.cfg.train.local_epochs if e is None else int(e)

    def personal_spec(self, state, ctx, clients, init, epochs: int, stream: str):
        t = self.cfg.train
        return pass_spec(t, clients, init, epochs, stream=stream, momentum=t.momentum,
                         prox_mu=float(self.hp("lam")), prox_anchor=broadcast(state.models, len(clients)))

    # ------------------------------------------------------------------ round
    def local_spec(self, state, ctx, clients, round):
        """FedAvg's spec for w; the personal pass on v_k runs in the same train shards, after
        the w-pass (``personal_pass``: its spec rides in ``meta``, restricted with the shard),
        so the executor distributes and retries it with the cohort's training. With no
        personal epochs, the rows ride as they are."""
        spec = Algorithm.local_spec(self, state, ctx, clients, round)
        v = {k: x.contiguous() for k, x in self.own_models(state, ctx, clients, None).items()}
        if not self.epochs():
            spec.meta = {**spec.meta, "personal": v}
            return spec
        stream = "shuffle" if self.hp("schedule") == "interleaved" else "personal"
        spec.meta = {**spec.meta, PERSONAL_SPEC: self.personal_spec(state, ctx, clients, v, self.epochs(), stream)}
        spec.personal_pass = ditto_pass
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
