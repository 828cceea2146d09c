"""Simulations are reproducible: the same seed yields the same journal, byte for byte."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from kvrouter.simulations.__main__ import main as simulations_main
from kvrouter.simulations.harness import SimulationOptions, SimulationResult, simulate


def run(seed: int, steps: int = 1500) -> SimulationResult:
    options = SimulationOptions(steps=steps, crash_probability=0.004)
    return trio.run(partial(simulate, seed, options), clock=trio.testing.MockClock(autojump_threshold=0))


def test_same_seed_same_journal_and_state() -> None:
    first, second = run(11), run(11)
    assert first.failures == () and second.failures == ()
    assert first.crashes > 0 and first.snapshots > 0, "the run should exercise crashes and snapshots"
    assert first.journal_digest == second.journal_digest
    assert first.state_digest == second.state_digest


def test_different_seeds_differ() -> None:
    assert run(11, 300).journal_digest != run(12, 300).journal_digest


def test_cli_prints_the_seed_and_passes(capsys) -> None:
    assert simulations_main(["--seed", "5", "--steps", "400"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed=5 ") and "journal_digest=" in out
