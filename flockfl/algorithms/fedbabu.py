"""FedBABU — Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022, https://arxiv.org/abs/2106.06042.

The head (``algorithm.personal_layers``, default the last Linear) is initialised once from the
run's seeded generator and **never updated** during federation: a 0-mask keeps it bit-identical
in both trainers (momentum included). Only the body trains and is averaged (``weighting``
uniform, as the official code); the head is never sent.

Evaluation: every client fine-tunes the final global model on its own training data for
``finetune_epochs`` epochs at ``finetune_lr`` with momentum ``finetune_momentum`` (the whole
model, as the paper, or the head only: ``finetune_parts``), and is measured with the result:
``accuracy`` = ``accuracy_personal``. ``accuracy_global`` is the model before fine-tuning
(body + init head), which the paper reports too. The fine-tuned copies are ephemeral (batch
orders from the ``fedbabu_finetune`` stream of the round): no per-client state. Newcomers and
``train.eval_finetune`` use the same fine-tuning.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flockfl.algorithms.hyper import choice, integer, real, sourced, weighting
from flockfl.algorithms.partial import PartialSharing, frozen_masks, partition_key
from flockfl.client import pass_spec, train_pass
from flockfl.engine.trainers import TrainResult
from flockfl.evaluation import measure_own


class FedBABU(PartialSharing):
    name = "fedbabu"
    paper = ("Oh et al., FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022, "
             "arXiv 2106.06042")
    hyperparameters = (
        weighting("uniform", source="code", note="jhoon-oh/FedBABU main_fed.py: the uniform mean of the bodies"),
        sourced(partition_key("personal_layers", "head", "the head, frozen at its seeded init during federation "
                              "(default head, the last Linear: the paper; none = FedAvg training)", "θ_cls"),
                "paper", "the linear classifier, randomly initialised once and never updated during federation"),
        integer("finetune_epochs", 5, "local fine-tuning epochs at evaluation (default 5: the official code's "
                "analysis notebook; 0 = the global model)", "τ_f", ge=0, source="code",
                note="jhoon-oh/FedBABU analysis.ipynb: 5 epochs (PFLlib 10)"),
        real("finetune_lr", 1e-3, "fine-tuning learning rate (default 1e-3: the official code)", "η_f", gt=0,
             source="code", note="jhoon-oh/FedBABU analysis.ipynb: SGD lr 1e-3 (PFLlib: the local lr)"),
        real("finetune_momentum", 0.9, "fine-tuning SGD momentum (default 0.9: the official code)", "", ge=0, lt=1,
             source="code", note="jhoon-oh/FedBABU analysis.ipynb: momentum 0.9"),
        choice("finetune_parts", "all", ("all", "head"), "what fine-tuning trains: all (body and head, the paper "
               "and official code) or head", source="paper",
               note="the whole model is fine-tuned (also jhoon-oh/FedBABU analysis.ipynb: body and head)"),
    )
    keeps_rows = False

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        if self.names(state):
            spec.masks = frozen_masks(spec.init, self.names(state), len(clients))
        return spec

    def tune(self, state, ctx, clients, round: int, stream: str) -> TrainResult | None:
        """The fine-tuned models of the listed clients (None when ``finetune_epochs`` is 0)."""
        epochs = self.hp("finetune_epochs")
        if not epochs:
            return None
        t, clients = self.cfg.train, np.asarray(clients, np.int64)
        init = self.own_models(state, ctx, clients, np.zeros(len(clients), np.int64))
        body = [k for k in init if k not in set(self.names(state))]
        masks = frozen_masks(init, body, len(clients)) if self.hp("finetune_parts") == "head" else None
        spec = pass_spec(t, clients, init, epochs, stream=stream, momentum=self.hp("finetune_momentum"), masks=masks)
        return train_pass(ctx, dataclasses.replace(spec, lr=self.hp("finetune_lr")), round)

    def chunk_metrics(self, state, ctx, clients, assign):
        out = super().chunk_metrics(state, ctx, clients, assign)
        res = self.tune(state, ctx, clients, state.round, "fedbabu_finetune")
        tuned = measure_own(ctx, res.params, clients) if res else out[""]
        return {"": tuned, "_global": out[""]}

    def finetune(self, state, ctx, clients, assign, round, stream):
        res = self.tune(state, ctx, clients, round, stream)
        if res is None:
            init = self.own_models(state, ctx, clients, np.zeros(len(clients), np.int64))
            n = len(clients)
            return TrainResult(np.asarray(clients), init, ctx.data.train.sizes[clients], np.zeros(n, np.int64), np.zeros(n))
        return res

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global model, fine-tuned on own data"
