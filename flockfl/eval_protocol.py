"""The evaluation protocols: which test set each client is measured on, which average over
clients and which evaluated round a run reports, the per-client metrics record those test sets
key, and the names each convention's summaries are logged under. The measuring itself is in
:mod:`flockfl.evaluation`; the reports over rounds in :mod:`flockfl.eval_summary`.

**Protocols** (config section ``eval``; the papers differ, so every run measures them all):

- test set: ``proportional`` (the partition's own split: a disjoint slice of the test set in the
  client's training class proportions) or ``label_union`` (every test sample of every label the
  client holds in training: the PACFL, FLIS and Sub-FedAvg code, the thesis);
- average over clients: weighted by test ``samples`` or unweighted over ``clients`` (those with
  test samples);
- report: which evaluated round the run's summary gives (:func:`flockfl.eval_summary.summarise`):
  the ``final`` one, the ``best``, the best at or after the first round by which every federating
  client has trained (``best_after_all_seen``, FlexCFL), or the mean of the last ``last_k``
  (``mean_last``).

**Names.** The plain names (``accuracy``, ``accuracy_min``, ``accuracy_p10``, ``loss`` and their
families ``accuracy_personal``, ``accuracy_global``, ``accuracy_finetuned``, ``accuracy_pruned``,
``unseen_accuracy``, …) follow the configured test set and average. Every evaluated round also
logs each convention: ``{name}__{test_set}__{average}`` for the means (``accuracy``, ``loss``)
and ``{name}__{test_set}`` for the quantiles (``_min``, ``_p10``), e.g.
``accuracy__label_union__clients`` and ``accuracy_min__label_union``. The last round adds
``{name}__{test_set}__{average}__{report}`` for every mean accuracy and every report mode.
Regression has no labels to hold: its only test set is ``proportional``; nor is ``label_union``
measured with ``partition.test_split=local`` (PFLlib's per-client held-out samples: no shared
test pool exists). :func:`flockfl.eval_summary.summarise` puts the last row's
``{name}__{test_set}__{average}__{report}`` values in its ``metrics`` too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import numpy as np

from flockfl.clientstate import joined
from flockfl.errors import ConfigError

if TYPE_CHECKING:
    from flockfl.context import RunContext

TEST_SETS = ("proportional", "label_union")
AVERAGES = ("samples", "clients")
REPORTS = ("final", "best", "best_after_all_seen", "mean_last")


@dataclass(frozen=True)
class Protocol:
    """How the run's headline metrics are measured and reported (config section ``eval``)."""

    test_set: str = "proportional"
    average: str = "samples"
    report: str = "final"
    last_k: int = 10

    @classmethod
    def of(cls, cfg) -> "Protocol":
        e = cfg.eval
        return cls(e.test_set, e.average, e.report, int(e.last_k))

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def check_protocol(cfg, task: str) -> None:
    """``label_union`` needs class labels: a one-line ConfigError for a regression task."""
    if cfg.eval.test_set == "label_union" and task != "classification":
        raise ConfigError(f"eval.test_set: 'label_union' needs class labels, and dataset {cfg.dataset.name!r} has float "
                          "labels (a regression task); use eval.test_set=proportional")


def protocol(ctx: RunContext) -> Protocol:
    check_protocol(ctx.cfg, ctx.data.task)
    return Protocol.of(ctx.cfg)


# ---------------------------------------------------------------------- the per-client metrics record


Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class ClientMetrics:
    """One family's per-client metrics (every listed client under the model the family gives it):
    for each test set, (mean loss, accuracy, test samples) per client. ``label_union`` exists
    for classification only."""

    sets: dict[str, Triple]

    def __getitem__(self, test_set: str) -> Triple:
        return self.sets[test_set]

    @staticmethod
    def join(parts: Iterable[Union["ClientMetrics", Triple]]) -> "ClientMetrics":
        """Chunks of clients, concatenated (a bare (loss, accuracy, count) triple is a
        proportional-only family, as the functions before the protocols returned)."""
        parts = [p if isinstance(p, ClientMetrics) else ClientMetrics({"proportional": tuple(p)}) for p in parts]
        if not parts:
            return ClientMetrics({"proportional": joined([])})
        common = set.intersection(*(set(p.sets) for p in parts))
        return ClientMetrics({ts: joined([p.sets[ts] for p in parts]) for ts in TEST_SETS if ts in common})


def overlay(base: ClientMetrics, pos: np.ndarray, part: Optional[ClientMetrics]) -> ClientMetrics:
    """``base`` with the clients at positions ``pos`` replaced by ``part``'s (in that order). A
    test set ``part`` was not measured on is dropped (``eval.conventions=cheap``: personal
    models are not measured on the label union), so no client's number comes from another model."""
    if part is None or len(pos) == 0:
        return base
    out = {}
    for ts in base.sets:
        if ts in part.sets:
            arrays = [np.array(a, copy=True) for a in base.sets[ts]]
            for a, b in zip(arrays, part.sets[ts]):
                a[pos] = b
            out[ts] = tuple(arrays)
    return ClientMetrics(out)


def label_union_applies(cfg, own: bool = False) -> bool:
    """Whether the ``label_union`` convention is measured, for shared models or (``own``) for
    per-client ones: not with ``partition.test_split=local`` (PFLlib's setting), where each
    client's test set is its own held-out samples and the dataset's test set is merged into the
    clients' data, so there is no shared pool to draw a label union from (``eval.test_set=
    label_union`` is refused there; its pass cost 24 of 31 s a round); always when it is the
    configured ``eval.test_set``; else per ``eval.conventions``: ``all`` yes, ``configured``
    no, ``cheap`` (the default) for shared models only (one pass per model, not one per client)."""
    if getattr(cfg.partition, "test_split", "global") == "local":
        return False
    ev = getattr(cfg, "eval", None)
    if ev is None or ev.test_set == "label_union":
        return True
    conventions = getattr(ev, "conventions", "cheap")
    return conventions == "all" or (conventions == "cheap" and not own)


# ---------------------------------------------------------------------- summaries of one family


def summarise_clients(c_loss: np.ndarray, c_acc: np.ndarray, n: np.ndarray, task: str, suffix: str = "",
                      average: str = "samples") -> dict[str, float]:
    """Mean loss (and accuracy, its minimum and 10th percentile) over clients: weighted by test
    ``samples``, or unweighted over the ``clients`` that have test samples."""
    has = n > 0
    w = n / max(n.sum(), 1) if average == "samples" else has / max(has.sum(), 1)
    out = {f"loss{suffix}": float((c_loss * w).sum())}
    if task == "classification":
        out[f"accuracy{suffix}"] = float((c_acc * w).sum())
        out[f"accuracy{suffix}_min"] = float(c_acc[has].min()) if has.any() else float("nan")
        out[f"accuracy{suffix}_p10"] = float(np.percentile(c_acc[has], 10)) if has.any() else float("nan")
    return out


def variant(name: str, test_set: str, average: Optional[str] = None) -> str:
    """The logged name of a metric under one convention (``accuracy__label_union__clients``;
    a quantile has no average: ``accuracy_min__label_union``)."""
    return f"{name}__{test_set}" if average is None else f"{name}__{test_set}__{average}"


def family(cm: ClientMetrics, proto: Protocol, task: str, suffix: str = "", wrap: Callable[[str], str] = str,
           keys: Optional[tuple[str, ...]] = None) -> dict[str, float]:
    """A family's summaries: the plain names under ``proto`` and every convention's variant.
    ``suffix`` goes inside the names (``accuracy_pruned_min``), ``wrap`` around them
    (``unseen_accuracy_min_untuned``); ``keys`` keeps only those (suffixed) names."""
    out: dict[str, float] = {}
    for ts, (loss, acc, n) in cm.sets.items():
        for avg in AVERAGES:
            for k, v in summarise_clients(loss, acc, n, task, suffix, avg).items():
                if keys is not None and k not in keys:
                    continue
                quantile = k.endswith(("_min", "_p10"))
                out[variant(wrap(k), ts, None if quantile else avg)] = v
                if ts == proto.test_set and avg == proto.average:
                    out[wrap(k)] = v
    return out
