"""The documentation site builds with mkdocs --strict: any warning (a broken link or anchor, a page missing from
the navigation, a bad config) fails the build, and so this test. README.md, outside the site, links into docs/:
each of its relative links must name a file that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
_LINK = re.compile(r"\[[^\]]*\]\((?!https?://|mailto:|#)([^)\s#]+)(#[^)\s]*)?\)")


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    config, site = str(ROOT / "mkdocs.yml"), str(tmp_path / "site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", config, "--site-dir", site],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_readme_links_name_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    targets = [match.group(1) for match in _LINK.finditer(text)]
    assert targets, "README links to the docs"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert missing == []


def test_a_broken_readme_link_is_found() -> None:
    assert [m.group(1) for m in _LINK.finditer("see [a](docs/nope.md#x) and [b](https://e.org/x) [c](#top)")] == [
        "docs/nope.md"
    ]
