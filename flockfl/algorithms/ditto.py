"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, https://arxiv.org/abs/2012.04221 (code litian96/ditto).

The global model w is plain FedAvg. Each selected client k also keeps a personal model v_k
and, each round it is selected, takes ``personal_epochs`` epochs of

    v_k ← v_k − η(∇F_k(v_k; b) + λ(v_k − w^t)),

anchored to the round-start global w^t: LocalSpec's proximal term (``prox_mu`` = λ,
``prox_anchor`` = w^t), so both trainers run it. The v-pass is built in the train shard from
the shard's own w-spec (:func:`personal_work`), after every stage has set it, so it takes the
w-pass's local work exactly: its epochs or ``train.local_steps`` steps, each client's epochs
under ``train.local_work=uniform_random``, a data curriculum's order and pacing, the lr
schedule, weight decay and ``train.momentum`` (heavy ball, reset every round). ``schedule``
says which batches:

- ``interleaved`` (default, the official code litian96/ditto): one v-step beside each w-step on
  the same mini-batch. v never feeds w and w^t is fixed during the round, so running the v-steps
  as one pass over the round's batch order (stream ``shuffle``) after the global pass gives
  exactly the interleaved result: the same batches, as many steps as w takes.
  ``personal_epochs`` cannot differ from the global pass's work (config error).
- ``sequential`` (PFLlib, FL-bench): the v-steps on their own batch order (stream
  ``personal``), the same local work as the global pass, or ``personal_epochs`` epochs for
  every client when set.

λ = 0 is local training; λ → ∞ gives v_k = w^t.

State: v_k in a :class:`~flockfl.clientstate.ClientTable` (``state.algo['personal']``); only
the cohort's rows are read and written. A client never seen starts from the current global w
(its row is unwritten). v_k never travels: bytes are FedAvg's 2|w|.

Evaluation (``eval``): ``accuracy_personal`` is each client's v_k, ``accuracy_global`` is w;
``accuracy`` is v_k's (``eval=personal``, default: the paper's and the official code's) or, per
evaluation and per convention, the better of the two mean accuracies (``eval=best_of``:
TsingZ0/PFLlib's serverditto.py appends the global and the personalised accuracy to the same
``rs_test_acc`` and reports its maximum; the losses, quantiles and per-client numbers stay
v_k's). Newcomers (and ``train.eval_finetune``) train a personal model from the global w with
the same proximal term.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from flockfl.algorithms.hyper import choice, integer, real, weighting
from flockfl.aggregation import broadcast
from flockfl.algorithms.personal import PersonalModels
from flockfl.client import finetune_epochs, pass_spec, train_pass
from flockfl.engine import TRAINERS
from flockfl.engine.schedule import LocalSpec, SecondPass


def personal_work(spec: LocalSpec) -> LocalSpec:
    """The v-pass of the clients of ``spec`` (a shard's w-spec, as the stages left it): the same
    local work, rate schedule, weight decay, momentum and curriculum as the w-pass, from each
    client's v_k with λ(v − w^t); its own batch order and, when set, its own epochs under
    ``schedule=sequential``. Nothing of the w-pass's own terms (masks, snapshots, solver)."""
    p, h = spec.second, spec.second.settings
    out = dataclasses.replace(spec, init=p.rows, prox_mu=float(h["lam"]), prox_anchor=p.anchor, stream=h["stream"],
                              meta=None, correction=None, masks=None, snapshot_steps=None, solver=None,
                              solver_vectorized=None, second=None, momentum_init=None)
    if h["epochs"] is not None:  # sequential with personal_epochs: every client that many epochs
        out = dataclasses.replace(out, epochs=int(h["epochs"]), steps=None, client_epochs=None, client_steps=None)
    return out


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
        integer("personal_epochs", None, "local epochs on v_k per selected round under schedule=sequential (default "
                "null = the global pass's local work: train.local_epochs, or train.local_steps steps, as PFLlib and "
                "FL-bench: one pass beside each global pass)", "s", ge=0, optional=True, source="code",
                note="litian96/ditto ditto.py: one v-step beside each of the local w-steps (PFLlib, FL-bench: 1 "
                     "personal epoch beside 1 global)"),
        choice("schedule", "interleaved", ("interleaved", "sequential"), "interleaved: a v-step beside each w-step on "
               "the same batch (the official code); sequential: the personal epochs on their own batch order, then the "
               "global ones (PFLlib, FL-bench)", source="code",
               note="litian96/ditto flearn/trainers_MTL/ditto.py: per minibatch one step on v, then one on w"),
        choice("eval", "personal", ("personal", "best_of"), "what accuracy reports: personal (each client's v_k, "
               "the paper's) or best_of (per evaluation, the better of the personalised and the global model's mean "
               "accuracy, PFLlib's leaderboard)", source="paper",
               note="the paper evaluates v_k (also litian96/ditto); TsingZ0/PFLlib serverditto.py puts the global "
                    "and the personalised accuracies in one rs_test_acc and reports its maximum: best_of"),
    )

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        a, t = cfg.algorithm, cfg.train
        e = getattr(a, "personal_epochs", None)
        if getattr(a, "schedule", "interleaved") != "interleaved" or e is None:
            return
        if t.local_steps is not None:
            raise ValueError(f"algorithm.personal_epochs: {e} personal epochs cannot interleave with "
                             f"train.local_steps={t.local_steps} (one v-step beside each w-step); leave it unset "
                             "or set algorithm.schedule=sequential")
        if e != t.local_epochs or t.local_work != "constant":
            what = (f"train.local_epochs={t.local_epochs}" if e != t.local_epochs
                    else f"train.local_work={t.local_work} (each client's own epochs)")
            raise ValueError(f"algorithm.personal_epochs: {e} personal epochs cannot interleave with {what} (one v-step "
                             "beside each w-step); leave it unset or set algorithm.schedule=sequential")

    def epochs(self) -> Optional[int]:
        """Personal epochs for every client (sequential with ``personal_epochs`` set), or None: the
        global pass's local work."""
        e: Optional[int] = self.hp("personal_epochs")
        return None if e is None or self.hp("schedule") == "interleaved" else int(e)

    def personal_spec(self, state, ctx, clients, init, epochs: int, stream: str):
        t = self.cfg.train
        return pass_spec(t, clients, init, epochs, stream=stream, momentum=t.momentum,
                         prox_mu=float(self.hp("lam")), prox_anchor=broadcast(state.models, len(clients)))

    # ------------------------------------------------------------------ round
    def local_spec(self, state, ctx, clients, round):
        """FedAvg's spec for w; the personal pass on v_k runs in the same train shards, after
        the w-pass (``spec.second``, restricted with the shard),
        so the executor distributes and retries it with the cohort's training. With no
        personal epochs, the rows ride as they are."""
        spec = super().local_spec(state, ctx, clients, round)
        v = {k: x.contiguous() for k, x in self.own_models(state, ctx, clients, None).items()}
        if self.epochs() == 0:
            spec.meta = {**spec.meta, "personal": v}
            return spec
        stream = "shuffle" if self.hp("schedule") == "interleaved" else "personal"
        spec.second = SecondPass(self.name, v, broadcast(state.models, len(clients)),
                                 {"lam": float(self.hp("lam")), "epochs": self.epochs(), "stream": stream})
        return spec

    @staticmethod
    def second_pass(model, spec, data, task, engine, seed, round):
        """The shard's v-pass (``spec.second``): λ-proximal SGD from each client's v_k, anchored
        to w^t, by the shard's trainer (:func:`personal_work`); its clients are the shard's."""
        return TRAINERS[engine](model, personal_work(spec), data, task, seed, round).params

    def evaluate(self, state, ctx) -> dict[str, Any]:
        """``eval=best_of``: every mean accuracy of the personal family (``accuracy`` and its
        conventions) is the better of v_k's and w's under the same convention."""
        out = super().evaluate(state, ctx)
        if self.hp("eval") != "best_of":
            return out
        for k in [k for k in out if k == "accuracy" or (k.startswith("accuracy__") and k.count("__") == 2)]:
            g = "accuracy_global" + k[len("accuracy"):]
            if g in out:
                out[k] = max(out[k], out[g])
        return out

    def finetune(self, state, ctx, clients, assign, round, stream):
        """``train.finetune_epochs`` personal epochs (the proximal step) from each client's v_k
        (from w for a newcomer)."""
        clients = np.asarray(clients, np.int64)
        init = self.own_models(state, ctx, clients, assign)
        return train_pass(ctx, self.personal_spec(state, ctx, clients, init, finetune_epochs(self.cfg.train), stream), round)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "a personal model trained from the global w (λ-prox)"
