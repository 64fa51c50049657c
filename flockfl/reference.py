"""The generated tables of the reference docs, and the command that rewrites them.

These blocks in ``docs/`` are generated, never written by hand:

- ``docs/config.md``, between ``<!-- config-table:start -->`` and ``<!-- config-table:end -->``:
  every config key, from the pydantic schema in :mod:`flockfl.config` (:func:`config_table`);
  between ``<!-- models:start -->`` / ``<!-- datasets:start -->`` / ``<!-- schemes:start -->``
  and their ``:end`` markers: the built-in models (with their parameter counts on common input
  shapes), datasets and partition schemes, from the registries ``models.MODELS``,
  ``flockfl.data.datasets.LOADERS`` and ``flockfl.data.schemes.SCHEMES`` (:func:`model_table`,
  :func:`dataset_table`, :func:`scheme_table`);
- ``docs/algorithms.md``, between ``<!-- algorithms:start -->`` and ``<!-- algorithms:end -->``:
  every algorithm, from the algorithms' own declarations (:func:`algorithm_table`), and between
  ``<!-- default-sources:start -->`` and ``<!-- default-sources:end -->``: where each seed
  method's defaults come from (paper, thesis, official code, library, or the data), per key
  (:func:`sources_table`).

``python -m flockfl.reference`` rewrites both in place (``--check`` only reports stale blocks);
``tests/test_docs.py`` and ``tests/test_hyper.py`` fail while a block is stale.

This module imports :mod:`flockfl.config`, :mod:`flockfl.algorithms` and the registries (and
torch, for the parameter counts) only inside the functions that need them.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- config table


def _field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the class's source: the ``# comment`` block directly above a
    field and the trailing ``# comment`` on its line(s), joined. Empty when the source cannot
    be read (a frozen or interactive build); the table then relies on descriptions alone."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(src)
        tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return {}
    lines = src.splitlines()
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line is the comment)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").strip()
            if text.startswith(("noqa", "type:", "pragma")):
                continue
            comments[row] = (text, not lines[row - 1][:col].strip())
    out: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        trailing = [comments[r][0] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if r in comments and not comments[r][1]]
        text = "; ".join(part for part in (" ".join(above), " ".join(trailing)) if part)
        if text:
            out[node.target.id] = text
    return out


def _literal_values(ann: Any) -> tuple | None:
    return typing.get_args(ann) if typing.get_origin(ann) is typing.Literal else None


def _type_text(ann: Any, metadata: list) -> str:
    """A field's type and allowed values, e.g. ``int ≥ 1``, ```a` / `b```, ``list of float or null``."""
    args = typing.get_args(ann)
    if type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        return _type_text(inner[0] if len(inner) == 1 else typing.Union[tuple(inner)], metadata) + " or null"
    values = _literal_values(ann)
    if values is not None:
        return " / ".join(f"`{_yaml(v)}`" for v in values)
    if typing.get_origin(ann) in (list, tuple):
        item = args[0] if args else Any
        return "list of " + _type_text(item, [])
    name = getattr(ann, "__name__", str(ann).replace("typing.", ""))
    bounds = {type(m).__name__: getattr(m, type(m).__name__.lower(), None) for m in metadata}
    low = f"{_num(bounds['Ge'])} ≤ " if "Ge" in bounds else f"{_num(bounds['Gt'])} < " if "Gt" in bounds else ""
    high = f" ≤ {_num(bounds['Le'])}" if "Le" in bounds else f" < {_num(bounds['Lt'])}" if "Lt" in bounds else ""
    if low and not high:  # "int ≥ 1" rather than "1 ≤ int"
        low_op = "≥" if "Ge" in bounds else ">"
        return f"{name} {low_op} {_num(bounds['Ge'] if 'Ge' in bounds else bounds['Gt'])}"
    return f"{low}{name}{high}"


def _num(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _yaml(value: Any) -> str:
    """A value as it is written in a YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        try:
            return f"`{_yaml(field.default_factory())}`"
        except TypeError:  # a factory that takes the validated data
            return "computed"
    if field.is_required():
        return "required"
    return f"`{_yaml(field.default)}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _is_section(ann: Any) -> bool:
    """A nested section (a pydantic model class) rather than a key."""
    return isinstance(ann, type) and hasattr(ann, "model_fields")


def _rows(prefix: str, cls: type, keys: list[str] | None = None) -> list[str]:
    comments = _field_comments(cls)
    rows = []
    for key, field in cls.model_fields.items():
        if keys is not None and key not in keys:
            continue
        meaning = field.description or comments.get(key, "")
        rows.append(f"| `{prefix}{key}` | {_cell(_type_text(field.annotation, field.metadata))} | "
                    f"{_cell(_default(field))} | {_cell(meaning)} |")
    return rows


def config_table() -> str:
    """docs/config.md's table: one row per config key (``section.key``), with its type or
    allowed values, default and meaning, from :class:`flockfl.config.ExperimentConfig`.

    A meaning is the field's ``description``, else the ``# comment`` above the field and on its
    line in its module of ``flockfl/config/``. The ``algorithm`` section's keys are per algorithm:
    its rows point to docs/algorithms.md."""
    from flockfl.config import ExperimentConfig

    lines = ["| key | type / allowed values | default | meaning |", "|---|---|---|---|"]
    top = [k for k, f in ExperimentConfig.model_fields.items() if not _is_section(f.annotation)]
    lines += _rows("", ExperimentConfig, top)
    for section, field in ExperimentConfig.model_fields.items():
        cls = field.annotation
        if not _is_section(cls):
            continue
        if cls.model_config.get("extra") == "allow":  # the algorithm block: keys per algorithm
            name = cls.model_fields.get("name")
            lines.append(f"| `{section}.name` | an algorithm's name | {_cell(_default(name)) if name else ''} | "
                         f"which algorithm runs: one of the table in [algorithms.md](algorithms.md) |")
            lines.append(f"| `{section}.<key>` | per algorithm | per algorithm | the chosen algorithm's own "
                         f"hyper-parameters, declared by each algorithm and checked when the config loads: "
                         f"see [algorithms.md](algorithms.md) or `flockfl list ALGORITHM` |")
            continue
        lines += _rows(f"{section}.", cls)
    return "\n".join(lines)


# ---------------------------------------------------------------------- the registries

# the input shapes of the model table: (shape, column header)
MODEL_SHAPES: list[tuple[tuple[int, ...], str]] = [
    ((1, 28, 28), "1×28×28 (MNIST, Fashion-MNIST)"),
    ((1, 8, 8), "1×8×8 (digits)"),
    ((3, 32, 32), "3×32×32"),
    ((60,), "60 features (synthetic_fedprox)"),
]
_BUILTIN = ("models", "flockfl")  # the packages whose registry entries are built in (not plugins)


def builtin(registry: dict[str, Any]) -> dict[str, Any]:
    """A registry's built-in entries, in registration order: its ``builtins()`` names where it
    has them (a :class:`flockfl.plugins.Registry`, read without loading any plugin), else the
    entries defined in flockfl's own packages. Plugins registered beside them are left out, so
    the docs do not depend on what is installed where they are generated."""
    names = getattr(registry, "builtins", None)
    if callable(names):
        return {k: dict.__getitem__(registry, k) for k in names()}
    return {k: v for k, v in registry.items() if getattr(v, "__module__", "").split(".")[0] in _BUILTIN}


def _first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, one line, reST ``code`` as markdown `code`."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "`")
    found = re.match(r"(.+?\.)(?=\s+[A-Z(]|$)", text)
    return found.group(1) if found else text


def _count(x: int) -> str:
    return f"{x:,}"


def model_table() -> str:
    """docs/config.md's table of ``model.name``: every built-in model of ``models.MODELS``, its
    docstring's first sentence and its parameter count (every tensor it sends and aggregates, BN
    statistics included) on the input shapes of :data:`MODEL_SHAPES`, with 10 outputs (1 for the
    regression models), or – where the model does not take that shape."""
    import torch

    from flockfl.config import REGRESSION_MODELS
    from models import MODELS

    lines = ["| `model.name` | what it is | " + " | ".join(h for _, h in MODEL_SHAPES) + " |",
             "|---|---|" + "---:|" * len(MODEL_SHAPES)]
    for name, build in builtin(MODELS).items():
        outputs = 1 if name in REGRESSION_MODELS else 10
        counts = []
        for shape, _ in MODEL_SHAPES:
            try:
                model = build(shape, outputs, 200).eval()
                with torch.no_grad():
                    model(torch.zeros(2, *shape))
                counts.append(_count(sum(p.numel() for p in model.parameters())))
            except (ValueError, RuntimeError, TypeError):
                counts.append("–")
        lines.append(f"| `{name}` | {_cell(_first_sentence(build.__doc__))} | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def _dataset_summaries() -> dict[str, str]:
    """``{dataset: summary}`` from the bullets of flockfl/data/datasets.py's module docstring
    (``- ``name`` / ``other``: summary;``)."""
    from flockfl.data import datasets

    out: dict[str, str] = {}
    for bullet in re.findall(r"^- (.+?)(?=^- |^\s*$)", datasets.__doc__ or "", re.M | re.S):
        names, _, text = " ".join(bullet.split()).partition(": ")
        for name in re.findall(r"``(\w+)``", names):
            out[name] = text.rstrip(";.") .replace("``", "`")
    return out


def dataset_table() -> str:
    """docs/config.md's table of ``dataset.name``: every built-in loader of
    ``flockfl.data.datasets.LOADERS``, its summary (the module docstring's bullet, else the
    loader's docstring) and the partition schemes it takes."""
    from flockfl.data.datasets import LOADERS, NATURAL_ONLY

    summaries = _dataset_summaries()
    lines = ["| `dataset.name` | what it is | schemes |", "|---|---|---|"]
    for name, load in builtin(LOADERS).items():
        text = summaries.get(name) or _first_sentence(load.__doc__)
        schemes = "`natural` only (each device is a client)" if name in NATURAL_ONLY else "any"
        lines.append(f"| `{name}` | {_cell(text)} | {schemes} |")
    return "\n".join(lines)


def scheme_summaries(root: Path = ROOT) -> dict[str, str]:
    """``{scheme: what each client gets}`` from the scheme table of docs/data.md."""
    text = (root / "docs" / "data.md").read_text()
    return {m[0]: m[1].strip() for m in re.findall(r"^\| `(\w+)` \|([^|]*)\|", text, re.M)}


def scheme_table() -> str:
    """docs/config.md's table of ``partition.scheme``: every built-in scheme of
    ``flockfl.data.schemes.SCHEMES`` with what each client gets (its row in docs/data.md's scheme
    table, else its function's docstring)."""
    from flockfl.data.schemes import SCHEMES

    rows = scheme_summaries()
    lines = ["| `partition.scheme` | what each client gets |", "|---|---|"]
    for name, make in builtin(SCHEMES).items():
        lines.append(f"| `{name}` | {_cell(rows.get(name) or _first_sentence(make.__doc__))} |")
    return "\n".join(lines)


def describe_stage(name: str) -> dict:
    """What ``flockfl list curriculum|pruning|shift`` shows: the stage's paper and every key of its
    config section with its default, allowed values and meaning."""
    from flockfl.config import ExperimentConfig
    from flockfl.stages import STAGES

    stage = {cls.name: cls for cls in STAGES}[name]
    cls = ExperimentConfig.model_fields[name].annotation
    comments = _field_comments(cls)
    rows = [{"key": f"{name}.{key}", "default": f.default, "allowed": _type_text(f.annotation, f.metadata).replace("`", ""),
             "symbol": "", "meaning": f.description or comments.get(key, "")} for key, f in cls.model_fields.items()]
    return {"name": name, "paper": stage.paper, "stages": [f"composes with every algorithm ({name})"], "hyperparameters": rows}


def algorithm_table() -> str:
    """docs/algorithms.md's table (the same as ``flockfl list --markdown``)."""
    from flockfl.algorithms import algorithm_table as table

    return table()


def sources_table() -> str:
    """docs/algorithms.md's table of the seed methods' defaults and where each comes from."""
    from flockfl.algorithms import sources_table as table

    return table()


# ---------------------------------------------------------------------- the docs


# (file, marker, what writes the block); a file may hold several blocks
BLOCKS: list[tuple[str, str, Callable[[], str]]] = [
    ("docs/config.md", "config-table", config_table),
    ("docs/config.md", "models", model_table),
    ("docs/config.md", "datasets", dataset_table),
    ("docs/config.md", "schemes", scheme_table),
    ("docs/algorithms.md", "algorithms", algorithm_table),
    ("docs/algorithms.md", "default-sources", sources_table),
]


def block_pattern(marker: str) -> re.Pattern:
    """The generated block between ``<!-- marker:start -->`` and ``<!-- marker:end -->``, each
    on its own line."""
    m = re.escape(marker)
    return re.compile(rf"^<!-- {m}:start -->\n(.*?)^<!-- {m}:end -->$", re.S | re.M)


def read_block(text: str, marker: str) -> str | None:
    """The block's text (without the markers and its last newline), or None without markers."""
    found = block_pattern(marker).search(text)
    return found.group(1).removesuffix("\n") if found else None


def write_docs(root: Path = ROOT, check: bool = False) -> list[str]:
    """Rewrite every generated block in place; returns the files that were (``check``: would
    be) changed. A file without its markers is an error: the markers are never removed."""
    changed = []
    for rel in dict.fromkeys(rel for rel, _, _ in BLOCKS):
        path = root / rel
        text = new = path.read_text()
        for marker, make in ((m, f) for r, m, f in BLOCKS if r == rel):
            if read_block(new, marker) is None:
                raise SystemExit(f"{rel}: the markers <!-- {marker}:start --> / <!-- {marker}:end --> are missing")
            block = f"<!-- {marker}:start -->\n{make()}\n<!-- {marker}:end -->"
            new = block_pattern(marker).sub(lambda _: block, new, count=1)
        if new != text:
            changed.append(rel)
            if not check:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    changed = write_docs(check=check)
    verb = "stale" if check else "rewrote"
    for rel in changed:
        print(f"{verb}: {rel}")
    if not changed:
        print("the generated docs tables are up to date")
    return 1 if (check and changed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
