"""The baselines compose with the stages like every algorithm (issue 20): each runs under a
distribution shift, a data curriculum, a client curriculum, Sub-FedAvg pruning and with
newcomers, and each stage visibly acts; where a method trains clients with its own solver
(Per-FedAvg, pFedMe) a data curriculum or pruning cannot apply and is refused in one line."""

from __future__ import annotations

import pytest

from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds

from conftest import tiny_config

BASELINES = ["cfl", "fedper", "lg_fedavg", "fedrep", "fedbabu", "fedbn", "ditto", "apfl", "perfedavg", "pfedme"]
SOLVERS = {"perfedavg", "pfedme"}  # local steps are their own solver: no paced batches, no masked SGD
# FedRep's head epochs run before the stages see the round: a data curriculum would pace its body epochs only
REFUSED = {("fedrep", "data_curriculum"): r"curriculum.ordering: curr would pace fedrep's body epochs only"}

# a split that leaves each method something personal (their defaults on the two-layer MLP would be
# FedAvg, which validation refuses): LG keeps the hidden layer local, FedBN gets a BatchNorm model
OWN = {"lg_fedavg": {"algorithm": {"name": "lg_fedavg", "global_layers": "top:1"}},
       "fedbn": {"algorithm": {"name": "fedbn"}, "model": {"name": "lenet5_bn"}}}

STAGES = {
    "shift": ({"shift": {"kind": "swap_all", "probability": 1.0}}, lambda h, last: sum(r["clients_shifted"] for r in h) > 0),
    "data_curriculum": ({"curriculum": {"ordering": "curr"}}, lambda h, last: "difficulty_std" in last),
    "client_curriculum": ({"curriculum": {"clients": True}}, lambda h, last: "client_pool" in last),
    "pruning": ({"pruning": {"method": "unstructured", "acc_threshold": 0.0}},
                lambda h, last: last["sparsity"] > 0),
    "newcomers": ({"partition": {"unseen_fraction": 0.25}}, lambda h, last: "unseen_accuracy" in last),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("name", BASELINES)
def test_baseline_composes_with_stage(name, stage, tmp_path):
    over, acted = STAGES[stage]
    over = {**OWN.get(name, {"algorithm": {"name": name}}), **over}
    if (name, stage) in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[name, stage]):
            validate(tiny_config(train={"rounds": 2}, **over))
        return
    cfg = validate(tiny_config(train={"rounds": 2}, **over))
    if name in SOLVERS and stage in ("data_curriculum", "pruning"):
        with pytest.raises(ConfigError, match=r"^(curriculum.ordering|pruning.method): .*own local solver"):
            run_rounds(prepare(cfg, tmp_path))
        return
    history = run_rounds(prepare(cfg, tmp_path)).history
    assert acted(history, history[-1]), (name, stage, history[-1])
    assert 0.0 <= history[-1]["accuracy"] <= 1.0
