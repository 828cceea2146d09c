"""Every page a docstring or comment cites ships with the repository, and so does the section it names.

Code cites the rules it implements by page and section (``behaviour.md#cost``, ``docs/operations/replicas.md``),
so a reader can follow them; a renamed heading or a moved page would leave the citation pointing nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("actors", "api", "client", "journal", "simulations", "tests", "benchmarks")
NOT_CITATIONS = {"tests/docs/test_docs_build.py"}  # names missing pages on purpose
CITATION = re.compile(r"(?<![\w/.-])((?:docs/[\w/-]+/?)?[\w-]+\.md)((?:#[\w-]+)(?:,\s*(?:#\s+)?#[\w-]+)*)?")
PAGES_OUTSIDE_DOCS = {"README.md"}
SEEDS = re.compile(r"^[\w-]+\.md$")  # the seeds' own names (``selection-service.md``) are the contract's, not pages


def slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (its default ``toc`` slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def resolve(cited: str) -> Path | None:
    if cited in PAGES_OUTSIDE_DOCS:
        return ROOT / cited
    if cited.startswith("docs/"):
        return ROOT / cited
    found = sorted((ROOT / "docs").rglob(cited))
    return found[0] if len(found) == 1 else None


def citations() -> list[tuple[str, str, str | None]]:
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if str(path.relative_to(ROOT)) in NOT_CITATIONS:
                continue
            for match in CITATION.finditer(path.read_text()):
                page, anchor = match.group(1), match.group(2)
                if anchor is None and SEEDS.match(page) and resolve(page) is None:
                    continue  # a seed document named by its file name, not a page of this site
                for each in re.findall(r"#[\w-]+", anchor or "") or [None]:
                    found.append((str(path.relative_to(ROOT)), page, each))
    return found


def test_the_code_cites_pages_by_section() -> None:
    cited = citations()
    assert len([c for c in cited if c[2] is not None]) > 40  # the scan really finds the docstrings' citations


def test_every_cited_page_and_section_exists() -> None:
    missing = []
    for source, page, anchor in citations():
        target = resolve(page)
        if target is None or not target.is_file():
            missing.append(f"{source}: {page} is no page of docs/")
        elif anchor is not None and anchor[1:] not in anchors(target):
            missing.append(f"{source}: {page}{anchor} names no heading of {target.relative_to(ROOT)}")
    assert missing == []
