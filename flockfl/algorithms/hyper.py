"""Hyper-parameter declarations: each algorithm declares its own ``algorithm.*`` keys.

An algorithm module lists its hyper-parameters next to its maths (the scikit-learn way:
constraints declared beside the code that uses them, checked once at the boundary)::

    class FedProx(Algorithm):
        hyperparameters = (real("mu", 0.01, "proximal weight", "μ", ge=0),)

The config checks ``algorithm.*`` against the chosen algorithm's declarations when it loads
(:func:`resolve`): a missing key gets its default, a bad value is a one-line error naming the
key and the allowed range, and a key the algorithm does not take is a one-line error that
names the algorithms that do take it. ``flockfl list ALGORITHM`` and README's algorithm table
are generated from the same declarations.

Every default says where it comes from (``source``, with an optional short ``note``): a registry
name is the method as published, so a reader of ``flockfl list ifca`` can tell the paper's
defaults from the library's choices (:data:`SOURCES`). A knob that the data must set (PACFL's
and FLIS's β) has ``source="data"`` and no default: the algorithm's ``check_config`` stops the
run with one line naming the key and the published values (:func:`missing`), instead of
quietly running another method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from flockfl.errors import did_you_mean


AUTO = "auto"  # the value of a key read from the data (flockfl.clustering.choose)


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


# where a default comes from (``Hyper.source``)
SOURCES: dict[str, str] = {
    "paper": "the method's publication (paper, or the seed that publishes it)",
    "thesis": "the thesis that runs it (seed 001, Vahidian 2023: PACFL, FLIS and their baselines)",
    "code": "the authors' official code (a script or its argparse default)",
    "library": "flockfl's choice: the publication gives no value, or the key is a library option",
    "data": "no default: the data must set it (the run stops with a one-line error until it is set)",
}


@dataclass(frozen=True)
class Hyper:
    """One hyper-parameter: name, default, meaning, the paper's symbol, its constraint and the
    source of its default (one of :data:`SOURCES`, "" where none is recorded; ``note`` says which
    table, script or value)."""

    name: str
    default: Any
    meaning: str
    symbol: str = ""
    kind: str = "real"  # real | int | choice | text | bool
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: tuple = ()
    optional: bool = False  # None is allowed (the meaning says what None stands for)
    auto: bool = False  # the word "auto" is allowed: the method reads the value from its evidence (clustering.choose)
    source: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.source and self.source not in SOURCES:
            raise ValueError(f"hyper-parameter {self.name}: source {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.source == "data" and self.default is not None:
            raise ValueError(f"hyper-parameter {self.name}: a key the data must set has no default (got {self.default!r})")

    # ------------------------------------------------------------------ description
    def allowed(self) -> str:
        """The constraint in words, e.g. ``0 ≤ x < 1`` or ``one of samples, uniform``."""
        if self.kind == "choice":
            text = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.kind == "text":
            text = "a string"
        elif self.kind == "bool":
            text = "true or false"
        else:
            lo = f"{_num(self.ge)} ≤ " if self.ge is not None else f"{_num(self.gt)} < " if self.gt is not None else ""
            hi = f" ≤ {_num(self.le)}" if self.le is not None else f" < {_num(self.lt)}" if self.lt is not None else ""
            noun = "an integer" if self.kind == "int" else "a number"
            text = f"{lo}x{hi}" if (lo or hi) else noun
            if self.kind == "int" and (lo or hi):
                text += ", an integer"
        return text + (", or auto" if self.auto else "") + (", or null" if self.optional else "")

    # ------------------------------------------------------------------ checking
    def check(self, value: Any, algorithm: str) -> Any:
        """The value, coerced to its kind; ValueError (one line) when it is not allowed."""
        where = f"algorithm.{self.name}"
        bad = f"{where}: {value!r} is not allowed for {algorithm}; allowed: {self.allowed()}"
        if self.auto and value == AUTO:
            return AUTO
        if value is None:
            if self.optional or self.source == "data":  # data: unset, the algorithm's check_config says what to set
                return None
            raise ValueError(bad)
        if self.kind == "choice":
            if value not in self.choices:
                raise ValueError(bad)
            return value
        if self.kind == "text":
            if not isinstance(value, str) or not value:
                raise ValueError(bad)
            return value
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(bad)
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(bad)
        if self.kind == "int":
            if float(value) != int(value):
                raise ValueError(bad)
            value = int(value)
        else:
            value = float(value)
        if ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)):
            raise ValueError(bad)
        return value


def _num(x: float) -> str:
    return f"{x:g}"


def real(name: str, default: Any, meaning: str, symbol: str = "", **bounds: Any) -> Hyper:
    return Hyper(name, default, meaning, symbol, "real", **bounds)


def integer(name: str, default: Any, meaning: str, symbol: str = "", **bounds: Any) -> Hyper:
    return Hyper(name, default, meaning, symbol, "int", **bounds)


def choice(name: str, default: Any, choices: tuple, meaning: str, symbol: str = "", optional: bool = False,
           **origin: str) -> Hyper:
    """``origin``: ``source`` and ``note`` (as every helper here takes them)."""
    return Hyper(name, default, meaning, symbol, "choice", choices=tuple(choices), optional=optional, **origin)


def text(name: str, meaning: str, **origin: str) -> Hyper:
    return Hyper(name, None, meaning, "", "text", optional=True, **origin)


def weighting(default: str, **origin: str) -> Hyper:
    """How client results are weighted in the server mean (every algorithm takes it)."""
    return choice("weighting", default, ("samples", "uniform"), "weights of the client results in the server mean: "
                  "samples (n_i) or uniform", "p_i", **origin)


def with_default(h: Hyper, default: Any) -> Hyper:
    return replace(h, default=default)


def sourced(h: Hyper, source: str, note: str = "") -> Hyper:
    """``h`` with the source of its default recorded (for a declaration built elsewhere)."""
    return replace(h, source=source, note=note)


def sourced_each(hs: tuple[Hyper, ...], origin: dict[str, tuple[str, str]]) -> tuple[Hyper, ...]:
    """Declarations shared by several algorithms (e.g. ``grouped.shift_hypers``), each with the
    source of its default as one algorithm states it: ``origin[name] = (source, note)``."""
    return tuple(sourced(h, *origin[h.name]) for h in hs)


def missing(algorithm: str, h: Hyper, alternatives: str = "") -> ValueError:
    """The one-line error for a key the data must set (``source="data"``) left unset: it names
    the key, the published values (``h.note``) and what to set."""
    return ValueError(f"algorithm.{h.name}: {algorithm} has no published default for {h.symbol or h.name}, it depends "
                      f"on the data ({h.note}); set algorithm.{h.name} (allowed: {h.allowed()}){alternatives}")


# ---------------------------------------------------------------------- resolution


def declared(cls: type) -> dict[str, Hyper]:
    """The hyper-parameters of an algorithm class: its own and its parents', the most
    derived declaration of a name winning."""
    out: dict[str, Hyper] = {}
    for klass in reversed(cls.__mro__):
        for h in klass.__dict__.get("hyperparameters", ()):
            out[h.name] = h
    return out


def takers(key: str, algorithms: dict[str, type]) -> list[str]:
    return sorted(name for name, cls in algorithms.items() if key in declared(cls))


def resolve(cls: type, given: dict[str, Any], algorithms: dict[str, type]) -> dict[str, Any]:
    """Check ``given`` against ``cls``'s declarations and fill in the defaults.

    Raises ValueError with one line for an unknown key or a value out of range."""
    decl = declared(cls)
    for key in given:
        if key not in decl:
            others = takers(key, algorithms)
            if others:
                raise ValueError(f"algorithm.{key}: {cls.name} does not take {key!r}; it is a hyper-parameter of "
                                 f"{', '.join(others)} (set algorithm.name to one of them, or drop the key)")
            raise ValueError(f"algorithm.{key}: unknown key for {cls.name}{did_you_mean(key, decl, 'algorithm.')}; it takes "
                             f"{', '.join(sorted(decl)) or 'no hyper-parameters'} (flockfl list {cls.name})")
    return {name: (h.check(given[name], cls.name) if name in given else h.default) for name, h in decl.items()}
