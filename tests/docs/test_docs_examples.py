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

from tests.support.doc_examples import ROOT, Chain, MarkerError, all_blocks, blocks_of, chains_of

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


def test_markers_say_how_a_block_runs() -> None:
    text = (
        "<!-- docs-test: background 8092,8101 -->\n```bash\nserve\n```\n"
        "<!-- docs-test: continue; errors -->\n```sh\ncurl\n```\n"
        "```text\nnot an example\n```\n"
        "<!-- docs-test: skip: needs a GPU; really -->\n```bash\nvllm serve\n```\n"
        "```bash\nalone\n```\n"
    )
    blocks = blocks_of(Path("page.md"), text)
    assert [(b.code, b.background_ports, b.continues, b.errors_expected, b.skip_reason) for b in blocks] == [
        ("serve\n", (8092, 8101), False, False, None),
        ("curl\n", (), True, True, None),
        ("vllm serve\n", (), False, False, "needs a GPU; really"),
        ("alone\n", (), False, False, None),
    ]
    assert [[b.code for b in chain.blocks] for chain in chains_of(blocks)] == [["serve\n", "curl\n"], ["alone\n"]]


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: skip: -->\n```bash\nx\n```\n",  # a skip without a reason
        "<!-- docs-test: sometimes -->\n```bash\nx\n```\n",  # an unknown directive
        "<!-- docs-test: background http -->\n```bash\nx\n```\n",  # a port that is not one
        "<!-- docs-test: continue -->\n```bash\nx\n```\n",  # nothing before it to continue
        "<!-- docs-test: errors -->\n```python\nx\n```\n",  # a marker on a block that is not an example
    ],
)
def test_a_bad_marker_is_refused(text: str) -> None:
    with pytest.raises(MarkerError):
        chains_of(blocks_of(Path("page.md"), text))


def test_a_block_fails_on_its_exit_status_or_an_error_body(tmp_path: Path) -> None:
    def run(code: str, errors: bool = False) -> int:
        block = {"where": "page.md:1", "code": code, "ports": [], "errors": errors}
        spec = tmp_path / "chain.json"
        spec.write_text(json.dumps({"workdir": str(tmp_path), "own_network": False, "blocks": [block]}))
        return subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, check=False).returncode

    assert run("echo fine") == 0
    assert run("false; echo after") == 1  # bash -e: a failing command fails the block
    assert run("false | cat") == 1  # pipefail
    assert run("""echo '{"error": "no"}'""") == 1
    assert run("""echo '{"error": "no"}'""", errors=True) == 0
