"""Algorithms, keyed by their registry name (``algorithm.name``)."""

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.ccfl import CCFL
from flockfl.algorithms.cfl import CFL, CFLPACFL
from flockfl.algorithms.fedavg import FedAvg
from flockfl.algorithms.fedavgm import FedAvgM
from flockfl.algorithms.fedeff import FedEff
from flockfl.algorithms.fednova import FedNova
from flockfl.algorithms.fedopt import FedAdagrad, FedAdam, FedYogi
from flockfl.algorithms.fedprox import FedProx
from flockfl.algorithms.fedsgd import FedSGD
from flockfl.algorithms.fedsc import FedSC
from flockfl.algorithms.fedsplit import FedSplit
from flockfl.algorithms.flis import FLISDC, FLISHC
from flockfl.algorithms.difca import DIFCA
from flockfl.algorithms.fedac import FedAC
from flockfl.algorithms.fedcluster import FedCluster
from flockfl.algorithms.fesem import FeSEM
from flockfl.algorithms.flexcfl import FlexCFL
from flockfl.algorithms.ifca import IFCA
from flockfl.algorithms.ifca_oneshot import IFCAOneShot
from flockfl.algorithms.local import Local
from flockfl.algorithms.pacfl import PACFL
from flockfl.algorithms.hyper import Hyper, declared
from flockfl.algorithms.scaffold import Scaffold
from flockfl.algorithms.fedbabu import FedBABU
from flockfl.algorithms.fedbn import FedBN
from flockfl.algorithms.fedper import FedPer
from flockfl.algorithms.fedrep import FedRep
from flockfl.algorithms.lg_fedavg import LGFedAvg
from flockfl.algorithms.ditto import Ditto
from flockfl.algorithms.apfl import APFL
from flockfl.algorithms.perfedavg import PerFedAvg
from flockfl.algorithms.pfedme import PFedMe
from flockfl.plugins import Registry


FAMILIES = ("global", "clustered", "personalised")  # Algorithm.family: how `flockfl list` groups methods


def _check_algorithm(name: str, cls: object) -> str:
    """What is wrong with ``cls`` as the algorithm ``name`` ("" when nothing is)."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        return f"{cls!r} is not a subclass of flockfl.algorithms.base.Algorithm"
    if cls.name != name:
        return f"its class attribute name is {cls.name!r}"
    if cls.family not in FAMILIES:
        return f"its family is {cls.family!r}; set family to one of {', '.join(FAMILIES)} (how flockfl list groups it)"
    if not all(isinstance(h, Hyper) for h in cls.__dict__.get("hyperparameters", ())):
        return "its hyperparameters must be Hyper declarations (flockfl.algorithms.hyper: real, integer, choice, text)"
    return ""


# the registry of ``algorithm.name``: the built-ins, then the plugins' (flockfl.plugins.register_algorithm)
ALGORITHMS: Registry = Registry("algorithm", {
    cls.name: cls
    for cls in (FedAvg, FedSGD, IFCA, FedProx, FedNova, Scaffold, FedAdam, FedAdagrad, FedYogi, FedAvgM, FedSplit, FedEff,
                CCFL, PACFL, FLISDC, FLISHC, FedSC, Local, IFCAOneShot, DIFCA, FedCluster, FedAC, FlexCFL, FeSEM, CFL, CFLPACFL,
                FedPer, LGFedAvg, FedRep, FedBABU, FedBN, Ditto, APFL, PerFedAvg, PFedMe)
}, check=_check_algorithm)


def build_algorithm(cfg) -> Algorithm:
    return ALGORITHMS[cfg.algorithm.name](cfg)


HOOKS = ("pre_federation", "select", "cycles_per_round", "shift_pool", "before_training", "model_of", "local_spec",
         "companion_spec", "cluster", "aggregate", "eval_assignment", "evaluate", "admit_newcomers")


# the smaller hooks a stage's default calls: overriding one of them changes the stage
PARTS = {"evaluate": ("evaluate", "personal", "own_models", "cluster_metrics")}


def overridden_stages(cls: type[Algorithm]) -> list[str]:
    """The hooks this algorithm defines itself (anywhere below the FedAvg base)."""
    return [h for h in HOOKS if any(getattr(cls, m) is not getattr(Algorithm, m) for m in PARTS.get(h, (h,)))]


def describe(name: str) -> dict:
    """What ``flockfl list ALGORITHM`` shows: the paper, the hyper-parameters (with where each
    default comes from: ``source`` is one of :data:`~flockfl.algorithms.hyper.SOURCES` or ""
    where none is recorded, ``source_note`` which table, script or value), the stages, and
    ``origin``: ``built-in`` or the plugin that registered it."""
    cls = ALGORITHMS[name]
    return {"name": name, "paper": cls.paper, "origin": ALGORITHMS.origin(name), "stages": overridden_stages(cls),
            "hyperparameters": [{"key": f"algorithm.{h.name}", "default": h.default, "allowed": h.allowed(),
                                 "symbol": h.symbol, "source": h.source, "source_note": h.note, "meaning": h.meaning}
                                for h in declared(cls).values()]}


def _default_cell(h: dict) -> str:
    """``(default, source)``; a key the data must set reads ``(set it, data)``."""
    value = "set it" if h["source"] == "data" else h["default"]
    return f"({value}, {h['source']})" if h["source"] else f"({value})"


def algorithm_table() -> str:
    """docs/algorithms.md's algorithm table, generated from the declarations (a test keeps it in step)."""
    lines = ["| name | paper | hyper-parameters (default, its source) | stages it overrides |", "|---|---|---|---|"]
    for name in ALGORITHMS.builtins():  # flockfl's own (a plugin's are not in its docs)
        d = describe(name)
        keys = ", ".join(f"`{h['key'].split('.', 1)[1]}` {_default_cell(h)}" for h in d["hyperparameters"])
        lines.append(f"| `{name}` | {d['paper']} | {keys} | {', '.join(d['stages']) or '– (FedAvg)'} |")
    return "\n".join(lines)


def sources_table() -> str:
    """docs/algorithms.md's table of where the defaults come from: one row per key of every
    algorithm whose keys all record a source (the seed methods), with the note."""
    lines = ["| algorithm | key | default | source | which value, where |", "|---|---|---|---|---|"]
    for name in ALGORITHMS.builtins():
        decl = declared(ALGORITHMS[name]).values()
        if not all(h.source for h in decl):
            continue
        for h in decl:
            default = "–" if h.source == "data" else f"`{h.default}`"
            note = h.note.replace("|", "\\|")
            lines.append(f"| `{name}` | `{h.name}` | {default} | {h.source} | {note} |")
    return "\n".join(lines)


__all__ = ["ALGORITHMS", "Algorithm", "algorithm_table", "build_algorithm", "describe", "sources_table"]
