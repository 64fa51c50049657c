"""A sweep's plan (:func:`plan_sweep`): every child run, a grid combination (``--grid``, parsed by
:func:`parse_grid`) or a named variant at one seed, with its config validated before anything
runs, and the digest that names the sweep."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


STACK_SIZE = 8  # cells trained together at most (each holds its data and models while the stack runs)


def add_run_options(p) -> None:
    """How a sweep's or a table's runs share the machine: ``--parallel``, ``--no-stack``, ``--stack-size``."""
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="processes at a time: this one and N - 1 workers, sharing the cores (each runs its stacks, or its runs one by one)")
    p.add_argument("--no-stack", action="store_true",
                   help=f"run the cells one by one (default: up to {STACK_SIZE} train together, one vectorised pass for all)")
    p.add_argument("--stack-size", type=int, default=None, metavar="N",
                   help=f"cells a stack at most (default {STACK_SIZE}; each holds its data and models while its stack runs)")


def stack_of(args) -> int:
    """The cells a stack at most that ``add_run_options``' flags ask for (0: one by one); a bad
    number (of cells or of processes) is a one-line ConfigError."""
    from flockfl.errors import ConfigError

    if args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: give a positive number of processes (1 runs the sweep in this one)")
    if args.stack_size is not None and args.stack_size < 1:
        raise ConfigError(f"--stack-size {args.stack_size}: give a positive number of cells a stack (1 runs them one by one)")
    return 0 if args.no_stack else (args.stack_size or STACK_SIZE)


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["train.lr=0.01,0.05", …]`` → ``[("train.lr", ["0.01", "0.05"]), …]`` (values stay text:
    ``--set`` parsing turns them into numbers, booleans or lists)."""
    from flockfl.errors import ConfigError

    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ConfigError(f"--grid {item!r}: write KEY=V1,V2 (e.g. --grid train.lr=0.01,0.05)")
        if key.strip() in {k for k, _ in out}:
            raise ConfigError(f"--grid {key.strip()} given twice; list all its values once: --grid {key.strip()}=V1,V2")
        out.append((key.strip(), vals))
    return out


@dataclass
class Child:
    """One run of the sweep: a grid combination at one seed."""

    label: str  # the combination, e.g. "train.lr=0.05 algorithm.k=2" ("base" without a grid)
    seed: int
    overrides: list[str]
    cfg: Any = None
    run_dir: Optional[Path] = None
    summary: Optional[dict] = None
    error: Optional[str] = None
    status: str = "pending"  # pending | finished | failed
    resumed: bool = False

    @property
    def key(self) -> str:
        return f"{self.label} seed={self.seed}"


@dataclass
class Plan:
    base: Any
    grid: list[tuple[str, list[str]]]
    seeds: list[int]
    children: list[Child] = field(default_factory=list)
    digest: str = ""


def plan_sweep(ref: str, grid: list[tuple[str, list[str]]], seeds: Optional[list[int]], overrides: list[str],
               params: str, variants: Optional[list[tuple[str, list[str]]]] = None) -> Plan:
    """Every child config, validated (a bad key or value is a one-line ConfigError before
    anything runs). ``variants`` ([(label, overrides)]) replaces the grid's cartesian product
    with named variants (benchmarks/compare.py: one per algorithm)."""
    from flockfl.experiments import load_experiment

    base = load_experiment(ref, overrides, params)
    seeds = list(dict.fromkeys(seeds)) if seeds else [base.seed]
    if variants is None:
        combos = itertools.product(*[[(k, v) for v in vals] for k, vals in grid]) if grid else [()]
        variants = [(" ".join(f"{k}={v}" for k, v in combo) or "base", [f"{k}={v}" for k, v in combo]) for combo in combos]
    plan = Plan(base, grid, seeds)
    for label, extra in variants:
        for seed in seeds:
            child = Child(label, seed, list(extra) + [f"seed={seed}"])
            child.cfg = load_experiment(ref, overrides + child.overrides, params)
            plan.children.append(child)
    keys = [c.cfg.digest() for c in plan.children]
    if len(set(keys)) < len(keys):
        from flockfl.errors import ConfigError

        raise ConfigError("two runs of the sweep have the same config; a --grid value repeats or overrides a --set")
    plan.digest = hashlib.sha256(json.dumps([[c.key, k] for c, k in zip(plan.children, keys)]).encode()).hexdigest()
    return plan
