"""The shell examples of README.md and docs/: found, grouped and described for tests/docs/test_docs_examples.py.

Every fenced block whose language is ``bash``, ``sh`` or ``shell`` is an example, and runs as written: in a
fresh empty directory (so a fresh data directory) where ``.venv`` is the virtual environment running the tests
and the repository's files are at hand (``examples/``, ``benchmarks/``, ...), with nothing else running and, where
the machine allows it, in a network namespace of its own (the fixed ports the docs use cannot meet anyone else's).
A block's output is not compared with the text around it; a block fails when it exits non-zero (it runs under
``bash -e -o pipefail``) or prints a kvrouter error body (``{"error": ...}``) without saying it expects one.

An HTML comment on the line before the fence changes that (invisible on GitHub and in the built site):

- ``<!-- docs-test: background 8092 -->``: the block starts a service that runs until stopped; it is started in
  the background and the next blocks run once 127.0.0.1:8092 accepts connections (several ports: ``8092,8101``);
- ``<!-- docs-test: continue -->``: the block runs in the directory of the block before it, with whatever that
  block started still running (a reader pasting them one after the other);
- ``<!-- docs-test: errors -->``: the block shows refusals on purpose (its output may hold ``{"error"``);
- ``<!-- docs-test: skip: WHY -->``: not run, for the reason given (rare: the reason is required; the rest of
  the comment is the reason).

The other directives combine with ``;`` (``continue; background 8093``). A chain is a block and the ``continue`` blocks
after it; whatever a chain started is stopped, by its process group, when the chain ends.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent.parent
SHELL_LANGUAGES = {"bash", "sh", "shell"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")


@attrs.frozen
class Block:
    path: Path  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    background_ports: tuple[int, ...] = ()
    continues: bool = False
    errors_expected: bool = False
    skip_reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@attrs.frozen
class Chain:
    """Blocks that run one after the other in one directory (the first and the ``continue`` blocks after it)."""

    blocks: tuple[Block, ...]

    @property
    def where(self) -> str:
        return self.blocks[0].where


class MarkerError(ValueError):
    pass


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, relative to ``root``."""
    pages = sorted(path.relative_to(root) for path in (root / "docs").rglob("*.md"))
    return [Path("README.md"), *pages]


def blocks_of(path: Path, text: str) -> list[Block]:
    """The shell blocks of one Markdown document, with the directives of the comment above each."""
    lines = text.splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            line = lines[end]
            body.append(line[indent:] if line[:indent].strip() == "" else line)
            end += 1
        if opening["info"].lower() in SHELL_LANGUAGES:
            marker = _marker_above(lines, index)
            found.append(_block(path, index + 1, "\n".join(body) + "\n", marker))
        elif _marker_above(lines, index) is not None:
            raise MarkerError(f"{path}:{index + 1}: a docs-test marker above a block that is not a shell example")
        index = end + 1
    return found


def _marker_above(lines: list[str], index: int) -> str | None:
    if index == 0:
        return None
    match = _MARKER.match(lines[index - 1])
    return match["body"].strip() if match else None


def _block(path: Path, line: int, code: str, marker: str | None) -> Block:
    block = Block(path, line, code)
    if marker is not None and marker.startswith("skip:"):  # the rest of the marker is the reason, ';' and all
        reason = marker[len("skip:") :].strip()
        if not reason:
            raise MarkerError(f"{path}:{line}: a skipped example must say why (skip: WHY)")
        return attrs.evolve(block, skip_reason=reason)
    for directive in (part.strip() for part in (marker or "").split(";")):
        word, _, rest = directive.partition(" ")
        if not directive:
            continue
        if word == "background":
            try:
                ports = tuple(int(port) for port in rest.split(","))
            except ValueError:
                raise MarkerError(f"{path}:{line}: background needs the port(s) it opens: {directive!r}") from None
            block = attrs.evolve(block, background_ports=ports)
        elif directive == "continue":
            block = attrs.evolve(block, continues=True)
        elif directive == "errors":
            block = attrs.evolve(block, errors_expected=True)
        else:
            raise MarkerError(f"{path}:{line}: unknown docs-test directive {directive!r}")
    return block


def chains_of(blocks: Iterable[Block]) -> list[Chain]:
    """Group each run of ``continue`` blocks with the block before it; skipped blocks form no chain."""
    chains: list[list[Block]] = []
    previous: Block | None = None
    for block in blocks:
        if block.skip_reason is not None:
            if block.continues:
                raise MarkerError(f"{block.where}: a skipped block cannot continue a chain")
            previous = None
            continue
        if block.continues:
            if previous is None or previous.path != block.path:
                raise MarkerError(f"{block.where}: 'continue' but no example before it on this page to continue")
            chains[-1].append(block)
        else:
            chains.append([block])
        previous = block
    return [Chain(tuple(chain)) for chain in chains]


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [block for path in documents(root) for block in blocks_of(path, (root / path).read_text())]
