"""The names flockfl's values have in MLflow, and a run read back under flockfl's names.

:func:`metric_name` gives a history row's key its MLflow metric name (the headline series under
their own names, each evaluation protocol's series under ``eval/``, per-cluster ones under
``cluster/``); numbers a run has once are logged as params (:func:`is_report_mode`,
``ONCE_PREFIXES``). :func:`summary_metrics` reads a run back under flockfl's names, whether it
was logged before or after the renaming.
"""

from __future__ import annotations

# A run's history rows and JSON summary keep flockfl's names (a contract); MLflow gets them
# sorted for a person: the headline series (accuracy, loss, ari, num_clusters, the round's
# accounting) under their own names, which sort together in every list MLflow shows (the run's
# metrics, the runs table's column chooser), and the long tail under a prefix. MLflow 3.17's
# charts make a section of everything before a name's last "/", and show the sections with a
# prefix first (sorted), the unprefixed ones ("Model metrics") after them:
#   F__TESTSET__AVERAGE, F_min__TESTSET, ... -> eval/<the same name>   (one "eval" section:
#       every protocol's series, every evaluated round; charts named as in the summary)
#   cluster/J/accuracy, cluster/J/clients   -> as they are              (a section per cluster)
# Numbers a run has once are params, not one-point metrics: the last round's report modes
# (F__TESTSET__AVERAGE__REPORT, under that name), the partition's measures (partition_*) and
# the pre-federation step's cost (pre_federation_*). :func:`summary_metrics` reads both ways back.
EVAL_PREFIX = "eval/"


def is_report_mode(key: str) -> bool:
    """Whether a history row's key is a report mode (``F__TESTSET__AVERAGE__REPORT``: the last
    round's value, logged once as a param)."""
    return key.count("__") == 3


def metric_name(key: str) -> str:
    """The MLflow metric name of a history row's key."""
    return EVAL_PREFIX + key if "__" in key and "/" not in key else key


def row_key(name: str) -> str:
    """The history row's key of an MLflow metric name (the inverse of :func:`metric_name`;
    a name from before the renaming is returned as is)."""
    rest = name[len(EVAL_PREFIX):]
    return rest if name.startswith(EVAL_PREFIX) and "__" in rest and "/" not in rest else name


ONCE_PREFIXES = ("partition_", "pre_federation_")


def summary_metrics(metrics: dict[str, float], params: dict[str, str]) -> dict[str, float]:
    """A run's final values under flockfl's names, whichever way the run was logged: its
    metrics renamed back (:func:`row_key`) plus the numbers logged once as params (report modes,
    partition measures, pre-federation cost). Runs logged before the renaming have them as
    metrics already, under these names."""
    out = {row_key(k): v for k, v in metrics.items()}
    for k, v in params.items():
        if k in out or not (is_report_mode(k) or k.startswith(ONCE_PREFIXES)):
            continue
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out
