"""The README and docs/: the generated config table is in step with the schema, the README stays
short, its quick start stays as scripts outside the repo use it, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flockfl.reference import config_table, read_block

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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
