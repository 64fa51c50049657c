"""The README and docs/: the generated tables of docs/config.md are in step with the schema and the
registries, every config key, model, dataset and scheme is documented, the README stays short,
its quick start stays as scripts outside the repo use it, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pydantic import BaseModel

from flockfl.reference import BLOCKS, builtin, config_table, read_block

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIG_MD = ROOT / "docs" / "config.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = ("config", "data", "algorithms", "engine", "operations", "benchmarks")

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def links(path: Path) -> list[str]:
    """Markdown link targets in ``path``, outside code blocks and code spans."""
    text = _CODE.sub("", _FENCE.sub("", path.read_text()))
    return _LINK.findall(text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    text = _FENCE.sub("", path.read_text())
    out = set()
    for heading in _HEADING.findall(text):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_config_table_is_generated_from_the_schema():
    block = read_block((ROOT / "docs" / "config.md").read_text(), "config-table")
    assert block is not None, "docs/config.md lost its <!-- config-table:start/end --> markers"
    assert block == config_table(), "docs/config.md's config table is stale: run `python -m flockfl.reference`"


@pytest.mark.parametrize("marker,make", [(m, f) for rel, m, f in BLOCKS if rel == "docs/config.md"],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_config_md_blocks_are_generated(marker, make):
    block = read_block(CONFIG_MD.read_text(), marker)
    assert block is not None, f"docs/config.md lost its <!-- {marker}:start/end --> markers"
    assert block == make(), f"docs/config.md's {marker} block is stale: run `python -m flockfl.reference`"


def schema_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the schema, ``section.key``, read from the pydantic classes themselves (not
    from the generator); a section open to extra keys (``algorithm``) adds ``section.<key>``."""
    keys = []
    for key, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += schema_keys(ann, f"{prefix}{key}.")
            if ann.model_config.get("extra") == "allow":
                keys.append(f"{prefix}{key}.<key>")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_every_config_key_is_in_the_doc_with_a_default_and_a_meaning():
    from flockfl.config import ExperimentConfig

    block = read_block(CONFIG_MD.read_text(), "config-table") or ""
    rows = {}
    for line in block.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0].strip("`")] = cells
    keys = schema_keys(ExperimentConfig)
    assert "eval.report" in keys and "algorithm.<key>" in keys
    missing = [k for k in keys if k not in rows]
    assert not missing, f"docs/config.md's key table lacks {missing}: run `python -m flockfl.reference`"
    blank = [k for k in keys if not (rows[k][1] and rows[k][2] and rows[k][3])]
    assert not blank, (f"docs/config.md: {blank} have no type, default or meaning; give each field a "
                       "description= in flockfl/config/")
    assert not set(rows) - set(keys), f"docs/config.md documents keys the schema lacks: {set(rows) - set(keys)}"


def test_every_section_is_named_in_the_prose():
    from flockfl.config import ExperimentConfig

    text = CONFIG_MD.read_text()
    intro = text.split("\n\n")[1]
    for section, field in ExperimentConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            assert f"`{section}`" in intro, f"docs/config.md's first paragraph does not name the {section} section"
            assert f"**`{section}`**" in text, f"docs/config.md's list of sections lacks {section}"


def test_every_builtin_model_dataset_and_scheme_is_documented():
    from flockfl.data.datasets import LOADERS
    from flockfl.data.schemes import SCHEMES
    from models import MODELS

    config = CONFIG_MD.read_text()
    data = (ROOT / "docs" / "data.md").read_text()
    for marker, registry in (("models", MODELS), ("datasets", LOADERS), ("schemes", SCHEMES)):
        names = re.findall(r"^\| `(\w+)` \|", read_block(config, marker) or "", re.M)
        assert names == list(builtin(registry)), f"docs/config.md's {marker} table is stale: run `python -m flockfl.reference`"
    datasets = data.split("## Datasets", 1)[1].split("\n## ", 1)[0]
    bullets = {n for b in re.findall(r"^- \*\*(.+?)\*\*", datasets, re.M) for n in b.split(" / ")}
    assert bullets == set(builtin(LOADERS)), f"docs/data.md's dataset list differs from the loaders: {bullets ^ set(builtin(LOADERS))}"
    table = data.split("## Partition schemes", 1)[1].split("\n#", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert rows == set(builtin(SCHEMES)), f"docs/data.md's scheme table differs from the schemes: {rows ^ set(builtin(SCHEMES))}"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 160, f"README.md has {n} lines; keep it at most 160 and move reference text to docs/"


def test_readme_keeps_the_quick_start_commands():
    text = README.read_text()
    assert "./run demo    # creates .venv" in text and "./run test    # the same setup" in text


def test_readme_links_every_docs_page_and_they_exist():
    targets = {t.split("#")[0] for t in links(README)}
    for page in PAGES:
        assert f"docs/{page}.md" in targets, f"README.md does not link docs/{page}.md"
        assert (ROOT / "docs" / f"{page}.md").is_file(), f"docs/{page}.md is linked from README.md but missing"
    for doc in DOCS:
        assert f"docs/{doc.name}" in targets, f"docs/{doc.name} is not linked from README.md"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: …
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {', '.join(broken)}"
