"""FedRep — Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021, https://arxiv.org/abs/2102.07078.

Model q_i = h_i ∘ φ. Round t: the server sends φ^t to the cohort; each client

1. takes ``head_epochs`` (τ_h) epochs on its head h_i with φ fixed;
2. takes ``body_epochs`` (τ_φ) epochs on φ with h_i fixed;
3. uploads φ_i; the server sets φ^{t+1} to their sample-weighted mean. Heads persist locally
   (ClientTable rows; a new client starts from the seeded init head).

Both phases are plain local SGD (``train.lr`` on its schedule, ``train.weight_decay``,
``train.batch_size``, ``train.momentum``; the optimiser state resets between phases), each phase
freezing the other part with a 0/1 mask, so both trainers run them. Phase 1 runs in
``local_spec`` (its batch orders from the ``fedrep_head`` stream), phase 2 is the round's
training. The local work is counted in epochs of each phase, τ_h and τ_φ, only:
``train.local_epochs`` is not used, and ``train.local_steps`` (which would override τ_φ and not
τ_h), ``train.local_work=uniform_random`` (each client's own E_i, which neither phase has) and a
data curriculum (which would pace the body epochs only: phase 1 runs before the stages see the
round) are refused in one line.

Evaluation: the current φ + the client's own h_i. Fine-tuning (``train.eval_finetune``) and
newcomers train the head only, from the global φ (the official code's final head-only epochs).
"""

from __future__ import annotations

import numpy as np

from flockfl.algorithms.hyper import integer, sourced, weighting
from flockfl.algorithms.partial import PartialSharing, frozen_masks, partition_key
from flockfl.client import finetune_epochs, pass_spec, round_spec, train_pass


class FedRep(PartialSharing):
    name = "fedrep"
    paper = "Collins et al., Exploiting Shared Representations for Personalized Federated Learning, ICML 2021, arXiv 2102.07078"
    hyperparameters = (
        weighting("samples", source="code", note="lgcollins/FedRep main_fedrep.py: n_i-weighted mean of φ_i (the "
                                                 "paper prints the plain mean)"),
        sourced(partition_key("personal_layers", "head", "the head h_i kept on each client (default head, the last "
                              "Linear: the official code's split)", "h_i"),
                "code", "lgcollins/FedRep: the representation is every layer but the final Linear (CNNCifar: fc3)"),
        integer("head_epochs", 10, "local epochs on the head, body fixed (default 10: the official code's CIFAR "
                "--local_ep 11 --local_rep_ep 1)", "τ_h", ge=0, source="code",
                note="lgcollins/FedRep scripts: CIFAR --local_ep 11 --local_rep_ep 1 (PFLlib 1, FL-bench 4)"),
        integer("body_epochs", 1, "local epochs on the body, head fixed, after the head epochs (default 1: the "
                "official code)", "τ_φ", ge=0, source="code",
                note="lgcollins/FedRep scripts: --local_rep_ep 1 on CIFAR (5 on FEMNIST)"),
    )

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        t = cfg.train
        if t.local_steps is not None:
            raise ValueError(f"train.local_steps: fedrep counts its local work in algorithm.head_epochs and "
                             f"algorithm.body_epochs; {t.local_steps} steps would replace the body epochs and not the "
                             "head epochs; drop train.local_steps")
        if t.local_work != "constant":
            raise ValueError(f"train.local_work: {t.local_work} draws each client's epochs from train.local_epochs, which "
                             "fedrep does not use (algorithm.head_epochs, algorithm.body_epochs); set "
                             "train.local_work=constant")
        if cfg.curriculum.ordering != "vanilla":
            raise ValueError(f"curriculum.ordering: {cfg.curriculum.ordering} would pace fedrep's body epochs only (the "
                             "head epochs run before the round's batches are paced); use curriculum.ordering=vanilla "
                             "(a client curriculum, curriculum.clients=true, still applies)")

    def local_spec(self, state, ctx, clients, round):
        t, names = self.cfg.train, self.names(state)
        init = self.own_models(state, ctx, clients, np.zeros(len(clients), np.int64))
        body = [k for k in init if k not in set(names)]
        if names and self.hp("head_epochs"):
            head = pass_spec(t, clients, init, self.hp("head_epochs"), stream="fedrep_head", momentum=t.momentum,
                             masks=frozen_masks(init, body, len(clients)))
            trained = train_pass(ctx, head, round).params
            init = {**init, **{k: trained[k] for k in names}}
        masks = frozen_masks(init, names, len(clients)) if names else None
        spec = round_spec(t, clients, init, meta={"model_of_client": np.zeros(len(clients), np.int64)}, masks=masks)
        spec.epochs = self.hp("body_epochs")  # train.local_steps, which would override it, is refused
        return spec

    def finetune(self, state, ctx, clients, assign, round, stream):
        """Head-only epochs (``train.finetune_epochs``) from the global φ + the client's head."""
        t = self.cfg.train
        clients = np.asarray(clients, np.int64)
        init = self.own_models(state, ctx, clients, np.asarray(assign, np.int64))
        body = [k for k in init if k not in set(self.names(state))]
        masks = frozen_masks(init, body, len(clients)) if self.names(state) else None
        return train_pass(ctx, pass_spec(t, clients, init, finetune_epochs(t), stream=stream, momentum=t.momentum,
                                         masks=masks), round)

    def admit_newcomers(self, state, ctx, newcomers):
        return state, self.eval_assignment(state, ctx)[newcomers], "the global body + a head fitted on own data"
