"""``kvrouter demo`` as a newcomer runs it (small numbers): a real process, the side-by-side table, the plot, and
nothing left running afterwards."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvrouter.api.cli.demo import ModeResult, Outcome, percentile, report, workload


def test_the_demo_runs_both_modes_and_prints_them_side_by_side(tmp_path: Path) -> None:
    # Four workers: round robin then keeps about a quarter of the reuse kv mode finds (two workers and 24
    # requests left it a coin toss per turn, and under load it once matched kv mode's share).
    command = [sys.executable, "-m", "kvrouter.api.cli.main", "demo", "--workers", "4", "--requests", "48"]
    command += ["--plots", str(tmp_path / "plots")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "--router-mode kv" in out and "--router-mode round-robin" in out
    reuse = re.search(r"prefix reuse \(cached / prompt tokens\)\s*│\s*([\d.]+)%\s*│\s*([\d.]+)%", out)
    assert reuse is not None, out
    # The same sessions: kv mode keeps each conversation on the worker that cached it.
    assert float(reuse[1]) > float(reuse[2]), out
    assert re.search(r"failed requests\s*│\s*0\s*│\s*0", out), out
    assert (tmp_path / "plots" / "demo.png").stat().st_size > 10_000
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flags", "text"), [(["--workers", "0"], "--workers: '0' must be between 1 and 16"), (["--x"], "unrecognized")]
)
def test_a_bad_flag_is_one_line_and_exit_2(flags: list[str], text: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvrouter.api.cli.main", "demo", *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], done.stderr


def test_the_workload_is_multi_turn_and_the_report_reads_its_figures() -> None:
    sessions = workload(10, seed=1)
    assert sum(len(session.turns) for session in sessions) == 10
    first = sessions[0].turns
    assert all(later.prompt[: len(earlier.prompt)] == earlier.prompt for earlier, later in itertools.pairwise(first))
    assert workload(10, seed=1) == sessions and workload(10, seed=2) != sessions
    outcomes = (Outcome(0.010, 0.1, 100, 50, 4, "1"), Outcome(0.030, 0.2, 100, 0, 4, "2"))
    text = report([ModeResult("kv", outcomes, 0, 2.0)], workers=2, requests=2, width=120)
    assert "25.0%" in text and "10.0 ms" in text and "30.0 ms" in text and "1.0 req/s, 4 tok/s" in text
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
