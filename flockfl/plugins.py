"""Plugins: a user's own algorithm, model, data set or partition scheme, registered without
touching flockfl's source (docs/plugins.md walks through a complete one).

Registering: the four registries (``ALGORITHMS``, ``models.MODELS``, ``LOADERS``, ``SCHEMES``)
are :class:`Registry` objects; flockfl's built-ins fill them, and plugins add to them with the
same functions, usable as decorators::

    from flockfl.plugins import register_algorithm, register_model

    @register_algorithm          # the key is the class's ``name``
    class TrimmedMean(Algorithm): name = "trimmed_mean"; ...

    @register_model              # the key is the function's name, or name="..."
    def tiny_cnn(input_shape, num_outputs, hidden=200): ...

Where plugins come from, both read once per process, lazily, at the first read of any
registry or the first config naming something that is not a built-in:

- entry points, in the groups ``flockfl.algorithms``, ``flockfl.models``, ``flockfl.datasets``
  and ``flockfl.schemes`` (the group names are a contract). An entry point names the object
  to register: an :class:`~flockfl.algorithms.base.Algorithm` subclass (its ``name`` is the
  key and must be the entry point's name) or a builder function (the entry point's name is
  the key). An entry point that names a module is imported, and the module registers what it
  holds with the functions above;
- ``FLOCKFL_PLUGINS=module[,module]``: modules imported by name from ``sys.path`` and the
  current folder (appended to ``sys.path``, and kept there, so that a Dask worker process
  started from here finds them too), each registering with the functions above.

A plugin that cannot be imported, registers a name a built-in has, or one another plugin has,
is a one-line :class:`PluginError` naming the plugin and the fix; it is raised again at every
later registry read, so no run starts without the plugins it was configured with.

``flockfl.plugin_sources`` lists the two sources (importing no plugin); this module imports
what they name, records what each registers and keeps the registries.

This module sits at the bottom of the import layers (it imports only ``flockfl.errors`` and
``flockfl.plugin_sources``, which imports nothing of flockfl's): the schema (``flockfl.config``)
asks it for plugin names, and the registries above build on it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from flockfl.errors import FlockError
from flockfl.plugin_sources import ENV, GROUPS, _describe, _entry_points, _kind_of, env_modules

KEYS = {"algorithm": "algorithm.name", "model": "model.name", "dataset": "dataset.name", "scheme": "partition.scheme"}
BUILTIN = "built-in"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


class PluginError(FlockError):
    """A plugin that cannot be loaded or registered (one line: the plugin, the problem, the fix)."""


@dataclass(frozen=True)
class Entry:
    obj: Any
    origin: str  # where it came from, in words ("plugin 'mine' (FLOCKFL_PLUGINS)")


# ---------------------------------------------------------------------- state (one per process)

_lock = threading.RLock()
_plugins: dict[str, dict[str, Entry]] = {kind: {} for kind in GROUPS}  # what plugins registered, by kind
_registries: dict[str, "Registry"] = {}
_version = 0  # bumped at every plugin registration; a registry merges when it has not seen the latest
_started = False  # load() began (a re-entrant call from a plugin being imported returns at once)
_done = False  # load() finished
_failure: Optional[str] = None  # the message of the PluginError that stopped load(), raised again later
_current: Optional[str] = None  # the origin of the plugin being imported now
_sources: list[str] = []  # the plugins loaded, in order


# ---------------------------------------------------------------------- registering


def register_algorithm(cls: type) -> type:
    """Register an algorithm class under its ``name`` (an :class:`~flockfl.algorithms.base.Algorithm`
    subclass; its declared ``hyperparameters`` are its ``algorithm.*`` keys). Returns the class,
    so it works as a class decorator."""
    name = getattr(cls, "name", None) if isinstance(cls, type) else None
    if not isinstance(name, str):
        raise PluginError(f"{_origin(cls)}: register_algorithm takes an Algorithm subclass with a class attribute "
                          f"name = '...', not {cls!r}")
    if "name" not in cls.__dict__:
        raise PluginError(f"{_origin(cls)}: algorithm class {cls.__name__} inherits name={name!r}; give it its own "
                          "class attribute name = '...'")
    _register("algorithm", name, cls)
    return cls


def register_model(fn: Optional[Callable] = None, /, *, name: Optional[str] = None):
    """Register a model builder ``fn(input_shape, num_outputs, hidden) -> torch.nn.Module`` under
    ``name`` (default: the function's name). ``@register_model``, ``@register_model(name="x")``
    or ``register_model(fn, name="x")``."""
    return _builder("model", fn, name)


def register_dataset(fn: Optional[Callable] = None, /, *, name: Optional[str] = None):
    """Register a dataset loader ``fn(cfg: DatasetConfig, seed, num_clients) -> Dataset`` under
    ``name`` (default: the function's name); used as :func:`register_model`."""
    return _builder("dataset", fn, name)


def register_scheme(fn: Optional[Callable] = None, /, *, name: Optional[str] = None):
    """Register a partition scheme ``fn(ds: Dataset, cfg: PartitionConfig, seed) -> Partition``
    under ``name`` (default: the function's name); used as :func:`register_model`."""
    return _builder("scheme", fn, name)


def _builder(kind: str, fn: Optional[Callable], name: Optional[str]):
    if fn is None:
        return lambda f: _builder(kind, f, name)
    if not callable(fn):
        raise PluginError(f"{_origin(fn)}: register_{kind} takes a function, not {fn!r}")
    _register(kind, name or fn.__name__, fn)
    return fn


def _origin(obj: Any) -> str:
    if _current:
        return _current
    module = getattr(obj, "__module__", None) or "?"
    return f"plugin module {module!r}"


def _same(a: Any, b: Any) -> bool:
    """The same object, or the same definition imported again (a module reloaded)."""
    key = lambda o: (getattr(o, "__module__", None), getattr(o, "__qualname__", None))  # noqa: E731
    return a is b or (key(a)[1] is not None and key(a) == key(b))


def _register(kind: str, name: str, obj: Any) -> None:
    global _version
    origin = _origin(obj)
    if not isinstance(name, str) or not _NAME.match(name):
        raise PluginError(f"{origin}: {kind} name {name!r} is not a valid name; use letters, digits, '_', '-' or '.', "
                          "starting with a letter")
    with _lock:
        have = _plugins[kind].get(name)
        if have is not None and not _same(have.obj, obj):
            raise PluginError(f"{origin}: {kind} {name!r} is already registered by {have.origin}; rename one of them")
        registry = _registries.get(kind)
        if registry is not None and name in registry._builtins:
            raise _clash(kind, name, origin)
        _plugins[kind][name] = Entry(obj, origin)
        _version += 1


def _clash(kind: str, name: str, origin: str) -> PluginError:
    return PluginError(f"{origin}: {kind} {name!r} clashes with flockfl's built-in {kind} of that name; give yours "
                       f"another name ({KEYS[kind]} then selects it)")


# ---------------------------------------------------------------------- the registries


class Registry(dict):
    """A registry: name → object, the built-ins first, then the plugins' entries.

    Every read (``[]``, ``in``, ``get``, iteration, ``len``, ``keys``/``values``/``items``)
    first loads the plugins (:func:`load`, once per process) and merges what they registered,
    so nothing can look a name up before the plugins are in. ``check(name, obj)`` returns a
    problem in words (or "") for an object offered under this registry's kind."""

    def __init__(self, kind: str, builtins: dict[str, Any], check: Optional[Callable[[str, Any], str]] = None):
        super().__init__()
        if kind not in GROUPS:
            raise ValueError(f"unknown registry kind {kind!r}; one of {', '.join(GROUPS)}")
        self.kind, self._check, self._seen = kind, check, -1
        for name, obj in builtins.items():
            problem = check(name, obj) if check else ""
            if problem:
                raise TypeError(f"built-in {kind} {name!r}: {problem}")
            dict.__setitem__(self, name, obj)
        self._builtins = tuple(builtins)
        _registries[kind] = self

    # -------------------------------------------------------------- what is where
    def builtins(self) -> tuple[str, ...]:
        """The built-in names, in registration order (the documentation's tables list these)."""
        return self._builtins

    def origin(self, name: str) -> str:
        """``built-in``, or where a plugin's entry came from."""
        self._ready()
        if name in self._builtins:
            return BUILTIN
        entry = _plugins[self.kind].get(name)
        return entry.origin if entry else ""

    # -------------------------------------------------------------- merging
    def _ready(self) -> None:
        if _done and self._seen == _version:
            return
        load()
        with _lock:
            if self._seen != _version:
                self._sync()

    def _sync(self) -> None:
        for name, entry in list(_plugins[self.kind].items()):
            if dict.get(self, name, None) is entry.obj:
                continue
            if name in self._builtins:
                raise _clash(self.kind, name, entry.origin)
            problem = self._check(name, entry.obj) if self._check else ""
            if problem:
                raise PluginError(f"{entry.origin}: {self.kind} {name!r}: {problem}")
            dict.__setitem__(self, name, entry.obj)
        self._seen = _version

    # -------------------------------------------------------------- reads (each loads the plugins first)
    def __getitem__(self, name):
        self._ready()
        return dict.__getitem__(self, name)

    def __contains__(self, name) -> bool:
        self._ready()
        return dict.__contains__(self, name)

    def __iter__(self) -> Iterator[str]:
        self._ready()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._ready()
        return dict.__len__(self)

    def __eq__(self, other) -> bool:
        self._ready()
        return dict.__eq__(self, other)

    __hash__ = None  # a dict

    def __repr__(self) -> str:
        self._ready()
        return f"Registry({self.kind!r}, {dict.__repr__(self)})"

    def get(self, name, default=None):
        self._ready()
        return dict.get(self, name, default)

    def keys(self):
        self._ready()
        return dict.keys(self)

    def values(self):
        self._ready()
        return dict.values(self)

    def items(self):
        self._ready()
        return dict.items(self)

    def copy(self) -> dict:
        self._ready()
        return dict(dict.items(self))


def names(kind: str) -> list[str]:
    """The names plugins registered for ``kind`` (loading the plugins first): the schema accepts
    these beside its built-in names."""
    load()
    return list(_plugins[kind])


def loaded() -> list[str]:
    """The plugins loaded in this process, each in words (for messages and ``flockfl list``)."""
    load()
    return list(_sources)


# ---------------------------------------------------------------------- loading


def load() -> None:
    """Import every plugin, once per process: the entry points of :data:`GROUPS`, then the
    modules of ``FLOCKFL_PLUGINS``. A failure is a :class:`PluginError` (one line), raised again
    on every later call."""
    global _started, _done, _failure
    if _done and _failure is None:
        return
    with _lock:
        if _failure is not None:
            raise PluginError(_failure)
        if _started:  # done, or a re-entrant call while a plugin is being imported
            return
        _started = True
        try:
            for ep in _entry_points():
                _load_entry_point(ep)
            for module in env_modules():
                _import_module(module)
        except PluginError as err:
            _failure = str(err)
            raise PluginError(_failure) from None
        finally:
            _done = True


def _load_entry_point(ep) -> None:
    global _current
    dist = getattr(getattr(ep, "dist", None), "name", None)
    origin = f"plugin {ep.name!r} (entry point {ep.value} in group {ep.group}{f' of {dist}' if dist else ''})"
    fix = f"fix it, or uninstall it (pip uninstall {dist})" if dist else "fix it, or uninstall the package that declares it"
    kind = _kind_of(ep.group)
    _current = origin
    try:
        try:
            obj = ep.load()
        except PluginError:
            raise
        except BaseException as err:  # SystemExit and KeyboardInterrupt from a plugin's import are its failure too
            if isinstance(err, KeyboardInterrupt):
                raise
            raise PluginError(f"{origin} failed to load: {_describe(err)}; {fix}") from None
        if inspect.ismodule(obj):  # the module registered what it holds as it was imported
            _sources.append(origin)
            return
        if kind == "algorithm":
            name = getattr(obj, "name", None) if isinstance(obj, type) else None
            if name is None:
                raise PluginError(f"{origin}: names {obj!r}, not an Algorithm subclass; point it at the class or at "
                                  "a module that registers it")
            if name != ep.name:
                raise PluginError(f"{origin}: the class's name is {name!r}; name the entry point {name} "
                                  f"({name} = {ep.value})")
            register_algorithm(obj)
        else:
            _builder(kind, obj, ep.name)
        _sources.append(origin)
    finally:
        _current = None


def _import_module(module: str) -> None:
    global _current
    origin = f"plugin {module!r} ({ENV})"
    if module.endswith(".py") or "/" in module or os.sep in module:
        stem = Path(module).stem
        raise PluginError(f"{origin}: {ENV} takes module names, not files; set {ENV}={stem} and run flockfl in "
                          f"the folder that holds {stem}.py")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # the current folder, after everything installed
        sys.path.append(cwd)
    _current = origin
    try:
        importlib.import_module(module)
    except PluginError:
        raise
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            raise PluginError(f"{origin}: no module {module!r} in {cwd} or on sys.path; run flockfl in the folder "
                              f"that holds {module.split('.')[0]}.py, install the package that provides it, or "
                              f"remove it from {ENV}") from None
        raise PluginError(f"{origin} failed to import: {_describe(err)}; install {err.name} or fix the plugin") from None
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        raise PluginError(f"{origin} failed to import: {_describe(err)}; fix it, or remove it from {ENV}") from None
    finally:
        _current = None
    _sources.append(origin)


def _forget() -> None:
    """Back to a process that loaded no plugin (tests): the registries keep their built-ins only."""
    global _version, _started, _done, _failure, _current
    with _lock:
        for kind, registry in _registries.items():
            for name in list(dict.keys(registry)):
                if name not in registry._builtins:
                    dict.__delitem__(registry, name)
            registry._seen = -1
        for table in _plugins.values():
            table.clear()
        _sources.clear()
        _version += 1
        _started = _done = False
        _failure = _current = None


__all__ = ["ENV", "GROUPS", "PluginError", "Registry", "env_modules", "load", "loaded", "names", "register_algorithm",
           "register_dataset", "register_model", "register_scheme"]
