"""An experiment's config from where users write it: a named experiment in ``params.yaml``,
a YAML file, and ``--set key=value`` overrides; validated against the schema
(``flockfl.config``) and the registries (each algorithm's declared keys, each dataset's
schemes). Everything is checked here, so nothing deeper needs defensive checks.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from flockfl.config import ExperimentConfig, deep_merge, validate_schema
from flockfl.errors import ConfigError, did_you_mean

PARAMS = "params.yaml"  # the file that marks a project's root (as dvc.yaml and .git mark theirs)


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn ``["train.lr=0.1", "algorithm.name=ifca"]`` into a nested dict. Values are read
    as YAML (numbers, booleans, lists), except for a key the schema or the algorithms declare
    as text: ``train.eval_finetune=off`` is the text 'off', not YAML's boolean."""
    nested: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.lr=0.1")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set {item!r}: empty key; expected key=value, e.g. --set train.lr=0.1")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if not isinstance(value, (str, list, dict)) and value is not None and is_text_key(key):
            value = raw.strip()
        node = nested
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p!r} is a value, not a section")
        node[parts[-1]] = value
    return nested


def _only_text(ann: Any) -> bool:
    """The annotation admits text and nothing else (None aside): str, or a Literal of strings."""
    args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) is typing.Union else [ann]
    if len(args) != 1:
        return False
    one = args[0]
    if typing.get_origin(one) is Literal:
        return all(isinstance(v, str) for v in typing.get_args(one))
    return one is str


def is_text_key(key: str) -> bool:
    """``key`` (dotted) is declared as text: by the schema, or for ``algorithm.*`` by every
    algorithm that declares it (a choice among strings, or free text)."""
    parts = key.split(".")
    if parts[0] == "algorithm" and len(parts) == 2 and parts[1] != "name":
        from flockfl.algorithms import ALGORITHMS
        from flockfl.algorithms.hyper import declared

        decl = [declared(cls)[parts[1]] for cls in ALGORITHMS.values() if parts[1] in declared(cls)]
        return bool(decl) and all(h.kind == "text" or (h.kind == "choice" and all(isinstance(c, str) for c in h.choices))
                                  for h in decl)
    model: type[BaseModel] = ExperimentConfig
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i == len(parts) - 1:
            return _only_text(field.annotation)
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return False
        model = field.annotation
    return False


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    """The whole validation: the schema, then what needs the registries. The algorithm's own
    keys are checked against its declaration and their defaults filled in."""
    cfg = validate_schema(raw)
    try:
        _check_registered(cfg)
    except ValueError as err:  # the same one-line form as the schema's own rules
        raise ConfigError(f"config error: {err}") from None
    return cfg


def _check_registered(cfg: ExperimentConfig) -> None:
    from flockfl.algorithms import ALGORITHMS
    from flockfl.algorithms.hyper import declared, resolve
    from flockfl.data.datasets import check_natural_only

    cls = ALGORITHMS.get(cfg.algorithm.name)
    if cls is None:
        raise ValueError(f"algorithm.name: unknown algorithm {cfg.algorithm.name!r}{did_you_mean(cfg.algorithm.name, ALGORITHMS)}; "
                         f"choose one of {', '.join(sorted(ALGORITHMS))} (flockfl list algorithms; a plugin's method "
                         "needs its package installed or FLOCKFL_PLUGINS set: docs/plugins.md)")
    resolved = resolve(cls, cfg.algorithm.hyper(), ALGORITHMS)
    extra = cfg.algorithm.__pydantic_extra__
    extra.clear()
    extra.update(resolved)
    part = cfg.partition
    if part.server_holdout is None:  # the server's own data, for the algorithms that need it
        part.server_holdout = int(resolved["server_data_size"]) if "server_data_size" in declared(cls) else 0
    cls.check_config(cfg)
    check_natural_only(cfg.dataset.name, part.scheme)
    _check_local_optimiser(cfg)
    _check_optimizer_state(cfg, cls)
    _check_test_split(cfg)
    _check_pruning(cfg, cls)


def _check_pruning(cfg: ExperimentConfig, cls: type) -> None:
    """Sub-FedAvg's server fills each client's pruned entries from its cluster's model
    (``flockfl/stages/subfedavg.py``), which a method that regroups its clients every round has not
    made yet (FLIS-DC: it crashed at the first aggregate)."""
    if cfg.pruning.method != "none" and not cls.cluster_ids_are_models:
        raise ValueError(f"pruning.method: Sub-FedAvg fills each client's pruned entries from its cluster's server model, "
                         f"but algorithm.name={cfg.algorithm.name} forms new clusters from every round's participants, "
                         "which have no server model yet; use pruning.method=none, or an algorithm with lasting "
                         "clusters (flis_hc clusters once)")


def _check_test_split(cfg: ExperimentConfig) -> None:
    """``partition.test_split=local`` merges the dataset's test set into the clients' data, so
    there is no global test set left for ``eval.test_set=label_union`` to draw from; and the
    local fraction means nothing without the local split."""
    part = cfg.partition
    default = type(part).model_fields["local_test_fraction"].default
    if part.test_split == "global" and part.local_test_fraction != default:
        raise ValueError(f"partition.local_test_fraction: {part.local_test_fraction} splits each client's own samples, "
                         "which only partition.test_split=local does; set test_split=local or remove it")
    if part.test_split == "local" and cfg.eval.test_set == "label_union":
        raise ValueError("eval.test_set: 'label_union' takes every test sample of a client's labels from the dataset's "
                         "test set, which partition.test_split=local merges into the clients' data; use "
                         "eval.test_set=proportional (each client's own local test split)")


def _own_local_update(cfg: ExperimentConfig) -> dict[str, str]:
    """The ``train.*`` optimiser terms (weight_decay, lr_schedule, momentum) a client of this
    algorithm cannot take, each with the one-line reason and fix. A method whose client runs its
    own loop honours the terms there (APFL's (v, α) loop and Per-FedAvg's meta-steps take all
    three, pFedMe's Moreau loop the schedule); what remains has no counterpart in it."""
    name, hp = cfg.algorithm.name, cfg.algorithm.hyper()
    refused: dict[str, str] = {}
    if (name == "fedsplit" and hp.get("prox") == "exact") or (name == "ifca" and hp.get("option") == "gradient"):
        own = ("the exact prox solve (prox=exact)" if name == "fedsplit"
               else "one gradient step at train.lr (option=gradient)")
        for key, fix in (("weight_decay", "weight_decay=0"), ("lr_schedule", "lr_schedule=constant")):
            refused[key] = (f"acts in the trainers' SGD step, but {name} trains each client with {own}; "
                            f"remove it (train.{fix})")
        if name == "fedsplit":
            refused["momentum"] = ("acts in the trainers' SGD step, but fedsplit trains each client with the exact prox "
                                   "solve (prox=exact), which has no steps; remove it (train.momentum=0)")
    if name == "pfedme":
        refused["weight_decay"] = ("pfedme's L2 term is algorithm.inner_l2 (μθ in each inner step; the official code's "
                                   "1e-3), and no pFedMe code decays w; set algorithm.inner_l2 instead "
                                   "(train.weight_decay=0)")
        refused["momentum"] = ("pfedme's inner solve and w-step are plain gradient steps (the paper and every code); "
                               "remove it (train.momentum=0)")
    return refused


def _check_local_optimiser(cfg: ExperimentConfig) -> None:
    """Weight decay, the learning-rate schedule and momentum act in every client's local steps:
    the trainers' SGD step, or a method's own loop that honours them (APFL, Per-FedAvg, pFedMe's
    schedule). Refuse them (one line) where a client's update has no such step
    (:func:`_own_local_update`), or where the algorithm's server step divides by one constant
    local η (SCAFFOLD option II's (x − y_i)/(Kη), FedNova's ‖a_i‖₁), instead of quietly
    ignoring or mis-scaling them."""
    t = cfg.train
    refused = _own_local_update(cfg)
    for key, given in (("weight_decay", bool(t.weight_decay)), ("lr_schedule", t.lr_schedule != "constant"),
                       ("momentum", bool(t.momentum))):
        if given and key in refused:
            raise ValueError(f"train.{key}: {getattr(t, key)!r} {refused[key]}")
    name, hp = cfg.algorithm.name, cfg.algorithm.hyper()
    if t.lr_schedule != "constant" and (name == "fednova" or (name == "scaffold" and hp.get("option") == "II")):
        what = "‖a_i‖₁ of one constant local η" if name == "fednova" else "(x − y_i)/(K·train.lr), one constant local η"
        raise ValueError(f"train.lr_schedule: {t.lr_schedule!r} changes the local rate, but {name} normalises by {what}; "
                         "use train.lr_schedule=constant")


def _check_optimizer_state(cfg: ExperimentConfig, cls: type) -> None:
    """``train.optimizer_state=persist`` keeps each client's local momentum buffer from one of its rounds to the
    next, in the trainers' SGD step. Refuse it (one line) where there is nothing to keep (no momentum), and where a
    client's local update is not (only) that step: a method whose own loop or second pass keeps buffers of its own
    that flockfl resets every round (APFL's (v, α) loop, Per-FedAvg's meta-steps, Ditto's v-pass, FedRep's head
    phase), a server step that assumes buffers starting at zero (FedNova's ‖a_i‖₁), or a client that sends one
    gradient (FedSGD, IFCA option=gradient: a kept buffer would send ρ·buf + g). pFedMe and FedSplit's exact prox
    refuse train.momentum already (:func:`_own_local_update`)."""
    from flockfl.algorithms import APFL, Ditto, FedNova, FedRep, FedSGD, IFCA, PerFedAvg

    t = cfg.train
    if t.optimizer_state != "persist":
        return
    fix = "set train.optimizer_state=reset"
    own = {APFL: "apfl's (v, α) loop keeps its own momentum buffers (one per model), which it resets every round",
           PerFedAvg: "perfedavg's meta-steps run in its own loop, whose one momentum buffer resets every round",
           Ditto: "ditto's personal v-pass is a second optimiser beside the w-pass's, which flockfl resets every round",
           FedRep: "fedrep's head and body phases each start a fresh optimiser every round (the official code's)",
           FedNova: "fednova normalises by the ‖a_i‖₁ of local momentum buffers that start at zero every round "
                    "(algorithm.momentum)"}
    for base, why in own.items():
        if issubclass(cls, base):
            raise ValueError(f"train.optimizer_state=persist: {why}; {fix}")
    if issubclass(cls, FedSGD) or (issubclass(cls, IFCA) and cfg.algorithm.hyper().get("option") == "gradient"):
        raise ValueError(f"train.optimizer_state=persist: {cfg.algorithm.name} sends one full-batch gradient a round, "
                         f"and a kept momentum buffer would send ρ·buf + g instead; {fix}")
    if not t.momentum:
        raise ValueError("train.optimizer_state=persist keeps nothing: the optimiser has no state (momentum 0, sgd); "
                         "set train.momentum or leave optimizer_state=reset")


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping (``what`` says of what); a one-line error otherwise."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping {what}")
    return data


def find_project_root(start: str | Path | None = None) -> Path | None:
    """The project's root: the nearest folder from ``start`` (default: the current one) upwards
    that holds a ``params.yaml``, as git and dvc find theirs; None outside a project."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / PARAMS).is_file():
            return folder
    return None


def no_project_error(start: str | Path | None = None, what: str = "") -> ConfigError:
    """The one-line error for a command that needs a project, run outside one."""
    here = Path(start or Path.cwd()).resolve()
    return ConfigError(f"no {PARAMS} in {here} or any folder above it{what}; run flockfl inside a flockfl project "
                       f"(a folder with {PARAMS}, e.g. a clone of flockfl), pass --params FILE, or give a YAML config path")


def load_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    p = Path(path)
    return read_mapping(p, "with 'partitions' and 'experiments'") if p.exists() else {}


def resolve_partition_ref(raw: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Inherit seed/dataset/partition from ``partitions.<partition.name>`` in params.yaml."""
    ref = (raw.get("partition") or {}).get("name")
    if not ref:
        return raw
    parts = params.get("partitions") or {}
    if ref not in parts:
        known = ", ".join(sorted(parts)) or "none"
        raise ConfigError(f"config error: partition.name {ref!r} is not in params.yaml partitions (known: {known})")
    base = {k: v for k, v in parts[ref].items() if k in ("seed", "dataset", "partition")}
    return deep_merge(base, raw)


def load_experiment(
    name_or_path: str, overrides: list[str] | None = None, params_path: str | Path = "params.yaml"
) -> ExperimentConfig:
    """Resolve a config from a params.yaml experiment name or a YAML file, plus ``--set`` overrides."""
    params = load_params(params_path)
    experiments = params.get("experiments") or {}
    path = Path(name_or_path)
    if name_or_path in experiments:
        raw = copy.deepcopy(experiments[name_or_path]) or {}
        raw.setdefault("name", name_or_path)
    elif path.suffix in (".yaml", ".yml", ".json") and path.exists():
        raw = read_mapping(path, "of config sections")
        raw.setdefault("name", path.stem)
    elif path.suffix in (".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {name_or_path!r} not found (looked in {Path.cwd()}); check the path")
    else:
        known = ", ".join(sorted(experiments)) or "none"
        raise ConfigError(
            f"unknown experiment {name_or_path!r}{did_you_mean(name_or_path, experiments)}: not a config file and not in "
            f"{params_path} (experiments: {known}; flockfl list experiments)"
        )
    over = parse_set(overrides or [])
    notices: list[str] = []
    raw = deep_merge(switch_algorithm(raw, over, notices.append), over)
    raw = resolve_partition_ref(raw, params)
    cfg = validate(raw)
    from flockfl.algorithms import ALGORITHMS

    for note in [*notices, *ALGORITHMS[cfg.algorithm.name].notes(cfg)]:  # only for a config that loads
        _notice(note)
    return cfg


def switch_algorithm(raw: dict[str, Any], override: dict[str, Any], notify=None) -> dict[str, Any]:
    """``--set algorithm.name=X`` on a config written for Y swaps the whole algorithm block
    (Hydra's config groups): every ``algorithm.*`` key the config set for Y is dropped (X runs
    with its own defaults, and the keys given with ``--set`` beside the name), with a one-line
    notice. The run then says the algorithm that ran: unless ``--set name=...`` names it, the
    config's name becomes ``<experiment>-<X>`` (its run directory, MLflow run name and
    registered model), filed under the experiment's MLflow experiment (``tracking.experiment``)."""
    new = (override.get("algorithm") or {}).get("name")
    old_block = raw.get("algorithm") or {}
    old = old_block.get("name", "fedavg")
    if not new or new == old:
        return raw
    given = override.get("algorithm") or {}
    dropped = sorted(k for k in old_block if k != "name" and k not in given)
    if dropped:
        (notify or _notice)(f"algorithm.name={new}: dropped {old}'s {', '.join(f'algorithm.{k}' for k in dropped)} "
                            f"(give any you want kept with --set)")
    out = dict(raw)
    out["algorithm"] = {"name": old}
    if "name" not in override and raw.get("name"):
        out["tracking"] = {"experiment": raw["name"], **(raw.get("tracking") or {})}
        out["name"] = f"{raw['name']}-{new}"
    return out


def _notice(message: str) -> None:
    import sys

    print(f"flockfl: note: {message}", file=sys.stderr)


def load_partition_config(name: str, params_path: str | Path = "params.yaml") -> ExperimentConfig:
    """A config holding just the partition named ``name`` in params.yaml."""
    params = load_params(params_path)
    parts = params.get("partitions") or {}
    if name not in parts:
        known = ", ".join(sorted(parts)) or "none"
        raise ConfigError(f"unknown partition {name!r}: not in {params_path} partitions (known: {known})")
    raw = {k: v for k, v in parts[name].items() if k in ("seed", "dataset", "partition")}
    extra = set(parts[name]) - {"seed", "dataset", "partition"}
    if extra:
        raise ConfigError(f"partitions.{name}: unknown keys {sorted(extra)}; a partition has seed, dataset and partition")
    raw = deep_merge(raw, {"partition": {"name": name}, "name": name})
    raw.setdefault("model", {"name": "linear" if raw.get("dataset", {}).get("name") == "synthetic_linreg" else "mlp"})
    raw.setdefault("train", {})
    raw["train"].setdefault("clients_per_round", 1)
    return validate(raw)
