"""README's embedding example runs as documented (a subprocess, as a user runs it) and prints what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "embedded_router.py"


def run_example(*args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_example_routes_to_the_cached_worker_and_reports_the_lifecycle() -> None:
    assert run_example() == [
        "best worker: 2 (dp_rank 0), 3 of 4 blocks cached",
        "worker 1: 0 active, 64 prefill tokens with this prompt",
        "worker 2: 1 active, 32 prefill tokens with this prompt",
        "refused (404): reservation req-1 not found",
        "indexed events: 1",
    ]


def test_with_a_data_dir_the_second_run_finds_the_first_runs_booking(tmp_path: Path) -> None:
    data = str(tmp_path / "router")
    assert (
        run_example("--data-dir", data)[-2] == "req-kept: booked; run again with the same --data-dir to find it there"
    )
    assert run_example("--data-dir", data)[-2] == "req-kept: booked by an earlier run, now freed"
