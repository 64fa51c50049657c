"""The import contract ``algorithms`` (pyproject.toml: one algorithm never imports another's
module) covers every algorithm: each module of flockfl/algorithms/ is either in its
independence list or a shared helper named below with the reason it is shared, so a new
algorithm module cannot be left out of the contract silently (issue 34). ``lint-imports``
itself runs in tests/test_layers.py."""

from __future__ import annotations

import tomllib

from conftest import ROOT

PACKAGE = "flockfl.algorithms"

# the modules that are meant to be imported by several algorithms, and why
SHARED = {
    "__init__": "the registry: imports every algorithm to list it",
    "base": "the Algorithm interface (FedAvg's hooks) every algorithm subclasses",
    "hyper": "the hyper-parameter declarations every algorithm's keys are written in",
    "auto": "the record of auto keys' decisions (k=auto, thresholds), for every method with an auto key",
    "layout": "which parameters are which: FedAC's embedding/decision split, IFCA's shared parameters",
    "model_choice": "a client's choice among k models (min loss, max confidence): IFCA, DIFCA, CFL",
    "oneshot": "the base of the methods that cluster once before round 0 (PACFL, FLIS, one-shot IFCA)",
    "grouped": "what FlexCFL and FeSEM share (group models, round-robin selection, the shift detector)",
    "personal": "the personalised family's base (each client measured with its own model)",
    "partial": "partial sharing, the personal family's mechanism for FedPer, LG-FedAvg, FedRep, FedBABU, FedBN",
    "ifca_init": "IFCA's initialisers: imported by ifca.py, reached by difca.py through IFCA (the IFCA family only)",
    "difca_reference": "DIFCA's reference-code variants (client copies), imported by difca.py only",
}

# imports between listed algorithms that the contract lets through, and why
ALLOWED_EDGES = {
    "flockfl.algorithms.difca -> flockfl.algorithms.ifca": "DIFCA is IFCA's decentralised variant: it subclasses IFCA",
}


def contract() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [found] = [c for c in project["tool"]["importlinter"]["contracts"] if c["id"] == "algorithms"]
    return found


def modules_on_disk() -> set[str]:
    here = ROOT / "flockfl" / "algorithms"
    return {p.stem for p in here.glob("*.py")} | {p.name for p in here.iterdir() if (p / "__init__.py").exists()}


def test_every_algorithm_module_is_in_the_independence_contract_or_a_named_shared_helper():
    c = contract()
    assert c["type"] == "independence"
    listed = {m.removeprefix(PACKAGE + ".") for m in c["modules"]}
    on_disk = modules_on_disk()
    left_out = on_disk - listed - set(SHARED)
    assert not left_out, (f"{sorted(left_out)}: neither in pyproject.toml's 'algorithms' independence contract nor a "
                          f"shared helper in tests/test_contracts.py's SHARED; list an algorithm in the contract")
    assert not listed & set(SHARED), f"{sorted(listed & set(SHARED))}: both independent and shared"
    assert not listed - on_disk, f"{sorted(listed - on_disk)}: in the contract, but no such module"
    assert not set(SHARED) - on_disk, f"{sorted(set(SHARED) - on_disk)}: in SHARED, but no such module"


def test_the_contract_lets_through_only_the_named_imports():
    ignored = set(contract().get("ignore_imports", []))
    assert ignored <= set(ALLOWED_EDGES), f"{sorted(ignored - set(ALLOWED_EDGES))}: ignored without a reason here"
