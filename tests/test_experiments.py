"""Loading an experiment: --set values reach the schema with the type it declares."""

from __future__ import annotations

import pytest

from flockfl.errors import ConfigError
from flockfl.experiments import is_text_key, load_experiment, parse_set, validate


def test_set_keeps_text_for_a_key_declared_as_text(workdir):
    # YAML reads `off` as the boolean False; train.eval_finetune declares 'final'|'every'|'off'
    assert parse_set(["train.eval_finetune=off"]) == {"train": {"eval_finetune": "off"}}
    cfg = load_experiment("fedavg_rotated_digits", ["train.eval_finetune=off"], workdir / "params.yaml")
    assert cfg.train.eval_finetune == "off"
    # quoted, as the only way that worked before, still works
    assert parse_set(["train.eval_finetune='off'"]) == {"train": {"eval_finetune": "off"}}


def test_set_still_reads_numbers_booleans_and_lists():
    assert parse_set(["train.lr=0.1", "train.full_batch=true", "train.simulate_failures=[1, 2]", "seed=3"]) == {
        "train": {"lr": 0.1, "full_batch": True, "simulate_failures": [1, 2]}, "seed": 3}
    assert parse_set(["partition.rho=null"]) == {"partition": {"rho": None}}


def test_text_keys_come_from_the_declarations():
    assert is_text_key("train.eval_finetune") and is_text_key("curriculum.expert") and is_text_key("algorithm.init")
    assert not is_text_key("train.lr") and not is_text_key("train.full_batch") and not is_text_key("algorithm.k")
    assert not is_text_key("no.such.key")


def test_a_text_key_given_a_wrong_word_is_one_line(workdir):
    with pytest.raises(ConfigError, match=r"train.eval_finetune.*'final', 'every' or 'off'.*got 'no'"):
        load_experiment("fedavg_rotated_digits", ["train.eval_finetune=no"], workdir / "params.yaml")


def test_the_schema_names_what_the_registries_hold():
    """flockfl/config/ (the bottom layer) spells the dataset, scheme and model names out as Literals;
    they are exactly the registries' keys."""
    import typing

    from flockfl.config import DatasetConfig, ModelConfig, PartitionConfig
    from flockfl.data.datasets import LOADERS
    from flockfl.data.schemes import SCHEMES
    from models import MODELS

    def names(section, key):
        return set(typing.get_args(section.model_fields[key].annotation))

    assert names(DatasetConfig, "name") == set(LOADERS)
    assert names(PartitionConfig, "scheme") == set(SCHEMES)
    assert names(ModelConfig, "name") == set(MODELS)
    assert names(PartitionConfig, "difficulty_model") == set(MODELS) - {"linear"}


@pytest.mark.parametrize("stage", ["curriculum", "pruning", "shift"])
def test_flock_list_describes_every_stage(stage, capsys):
    from flows.cli import main

    assert main(["list", stage, "--json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["paper"] and d["hyperparameters"] and all(h["key"].startswith(f"{stage}.") for h in d["hyperparameters"])
    assert any(h["allowed"] for h in d["hyperparameters"])


def test_the_config_digest_ignores_keys_left_at_their_defaults():
    # a key added to the schema later (at its default) must not make a sweep begun before it
    # "another sweep": the digest covers what differs from the defaults
    from conftest import tiny_config

    plain = validate(tiny_config())
    assert plain.digest() == validate(tiny_config(eval={"conventions": "cheap", "last_k": 10})).digest()
    assert plain.digest() != validate(tiny_config(eval={"conventions": "configured"})).digest()
    assert plain.digest() != validate(tiny_config(train={"rounds": 7})).digest()
