"""The sections of the stages that compose with every algorithm: ``shift`` (client-level
distribution shift), ``curriculum`` (data and client curricula) and ``pruning`` (Sub-FedAvg).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from flockfl.config.section import _Section


class ShiftConfig(_Section):
    """Client-level distribution shift (FlexCFL §3, ``flockfl/stages/shift.py``): applied each round
    after client selection and before any clustering step; the union of the clients' data never
    changes. Deterministic given (seed, round), and part of the state."""

    kind: Literal["none", "swap_all", "swap_part", "incremental"] = Field(
        "none", description="none; swap_all (paired clients swap all their data), swap_part (each of a pair gives the "
                            "other a label it lacks) or incremental (each client's data released step by step)")
    probability: float = Field(0.05, ge=0, le=1)  # swap_*: each pair of clients swaps with this probability
    start_round: int = Field(0, ge=0)  # the first round (0-based) a shift may happen
    # incremental: each client's training data is released step by step: `release` more of it
    # every `every` rounds from start_round (0.25, 50: 1/4, 1/2, 3/4, all at rounds 0, 50, 100, 150)
    release: float = Field(0.25, gt=0, le=1)
    every: int = Field(50, ge=1, description="incremental: rounds between two releases")
    # paper_intent, or code_faithful: the official code's quirks (incremental sizes computed from the
    # current size, so released data shrinks; swap_part stops the round at a pair with no exclusive label)
    mode: Literal["paper_intent", "code_faithful"] = "paper_intent"


class CurriculumConfig(_Section):
    """Data and client curricula (thesis Chapter 2, ``flockfl/stages/curriculum.py``), for any
    algorithm. Off by default (``ordering=vanilla`` and ``clients=false``)."""

    ordering: Literal["vanilla", "curr", "anti", "random"] = Field(
        "vanilla", description="order of each client's samples: vanilla (off), curr (easy first), anti (hard first), random")
    scoring: Literal["s_G", "s_L", "s_LG", "s_G_pred", "s_L_pred", "s_LG_pred", "s_E"] = Field(
        "s_G", description="difficulty score (§1.3): loss under the received model (s_G), the client's last local "
                           "model (s_L), both (s_LG), the prediction checks (*_pred), or the expert (s_E)")
    pacing: Literal["linear", "exp", "step", "root", "quad"] = Field("linear", description="pacing family g(t) (Table 2.1)")
    a: float = Field(0.8, ge=0, le=1, description="share of the local budget after which all samples are used")
    b: float = Field(0.2, ge=0, le=1, description="share of the samples exposed at the first step")
    pacing_literal: bool = Field(False, description="the printed (N − b) growth of the root/linear/quad rows instead of N(1 − b)")
    pacing_scope: Literal["round", "global"] = Field(
        "round", description="the pacing clock: each round's local steps (Algorithm 1) or the whole run's")
    clients: bool = Field(False, description="client curriculum (§1.5): the cohort comes from a paced pool of ranked clients")
    client_ordering: Optional[Literal["curr", "anti", "random"]] = Field(
        None, description="order of the clients (null: the data ordering, or curr when that is vanilla)")
    client_scoring: Literal["s_G", "s_E"] = Field("s_G", description="client score 1/L_k under the global (s_G) or expert (s_E) model")
    expert: str = Field("global", description="the expert model of s_E: global (the current server model, so s_E = s_G), "
                                              "an MLflow model URI (models:/NAME/VERSION, runs:/ID/model_0) or a .pt file")
    local_model: Literal["persisted", "received"] = Field(
        "persisted", description="s_L's local model: the client's model from its last participation (the received one "
                                 "until it has one), or always the received one")


class PruningConfig(_Section):
    """Sub-FedAvg pruning (thesis Chapter 4, ``flockfl/stages/subfedavg.py``), for any algorithm.
    Off by default (``method=none``)."""

    method: Literal["none", "unstructured", "structured", "hybrid"] = Field(
        "none", description="none, unstructured (Algorithm 10), structured (BN channels) or hybrid (Algorithm 11)")
    target: float = Field(0.5, gt=0, lt=1, description="share of prunable weights to reach (p_us; hybrid: of the FC weights)")
    rate: float = Field(0.1, gt=0, le=1, description="share of the still-alive weights pruned per prune event (r_us)")
    mask_threshold: Optional[float] = Field(
        None, ge=0, description="ε_us, the first/last-epoch mask distance below which a client stops pruning "
                                "(null: 1e-4 unstructured, 0.05 hybrid, the seed's values)")
    channel_target: float = Field(0.5, gt=0, lt=1, description="share of BN channels to prune (p_s; structured, hybrid)")
    channel_rate: float = Field(0.1, gt=0, le=1, description="share of a layer's alive channels pruned per event (r_s)")
    channel_threshold: float = Field(0.05, ge=0, description="ε_s, the channel-mask distance threshold")
    acc_threshold: float = Field(0.5, ge=0, le=1, description="Acc_th: a client prunes only while its accuracy is at least this")
    acc_gate: Literal["after_mask", "before_training"] = Field(
        "after_mask", description="when the accuracy gate is measured: on the masked model after training (the "
                                  "authors' code) or on the received model before training (Algorithm 10)")
