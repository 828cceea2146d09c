"""Every shell example of README.md and docs/ runs as written (conventions: tests/support/doc_examples.py).

Each chain of examples runs in a fresh directory where ``.venv`` is the environment running these tests and the
repository's files are linked in, through tests/support/doc_example_runner.py; where ``unshare --net`` works (as
root, or with user namespaces) it runs in a network namespace of its own, so the docs' fixed ports (8091, 8092,
8000, ...) meet no other process on the machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import attrs
import pytest

from tests.support.doc_examples import ROOT, Chain, MarkerError, all_blocks, chains_of

RUNNER = ROOT / "tests" / "support" / "doc_example_runner.py"
PARALLEL_CHAINS = 4
MAX_SKIPPED = 5  # skipping must stay rare: the two install commands CI runs itself, GPU engines, the reference
NOT_LINKED = {".git", ".venv", "kvrouter-data", "site", "build", ".pytest_cache", ".ruff_cache", ".hypothesis"}


def collected() -> tuple[list[Chain], str | None]:
    try:
        return chains_of(all_blocks()), None
    except MarkerError as error:
        return [], str(error)


CHAINS, MARKER_ERROR = collected()


@cache
def own_network() -> bool:
    """Whether a chain can run in a network namespace of its own (``unshare --net`` and ``ip`` usable)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, check=False)
    return probe.returncode == 0


def workdir_for(tmp_path: Path) -> Path:
    """A fresh directory as a reader's checkout looks: the repository's files, ``.venv``, no data directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    for entry in ROOT.iterdir():
        hidden = entry.name.startswith(".") and entry.name != ".ci"
        if not hidden and entry.name not in NOT_LINKED and not entry.name.endswith(".egg-info"):
            (work / entry.name).symlink_to(entry)
    return work


def test_the_markers_parse() -> None:
    assert MARKER_ERROR is None


def test_skipped_examples_are_few_and_say_why() -> None:
    skipped = [block for block in all_blocks() if block.skip_reason is not None]
    assert all(block.skip_reason for block in skipped)
    assert len(skipped) <= MAX_SKIPPED, [block.where for block in skipped]


@attrs.frozen
class Outcome:
    returncode: int
    output: str
    seconds: float


def run_chain(chain: Chain, tmp_path: Path, isolated: bool) -> Outcome:
    work = workdir_for(tmp_path)
    spec = {
        "workdir": str(work),
        "own_network": isolated,
        "blocks": [
            {"where": block.where, "code": block.code, "ports": list(block.background_ports),
             "errors": block.errors_expected}
            for block in chain.blocks
        ],
    }  # fmt: skip
    spec_file = tmp_path / "chain.json"
    spec_file.write_text(json.dumps(spec))
    command = [sys.executable, str(RUNNER), str(spec_file)]
    if isolated:
        command = ["unshare", "--net", "--", *command]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    return Outcome(result.returncode, result.stdout + result.stderr, time.monotonic() - started)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every chain's outcome. In network namespaces of their own the chains cannot meet on a port, so they run
    a few at a time (most of a chain's time is services starting and waiting); otherwise one after another."""
    isolated = own_network()
    workers = PARALLEL_CHAINS if isolated else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {
            chain.where: pool.submit(run_chain, chain, tmp_path_factory.mktemp("chain"), isolated) for chain in CHAINS
        }
        return {where: future.result() for where, future in futures.items()}


@pytest.mark.parametrize("chain", CHAINS, ids=[chain.where for chain in CHAINS])
def test_example_runs_as_written(chain: Chain, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[chain.where]
    assert outcome.returncode == 0, outcome.output
