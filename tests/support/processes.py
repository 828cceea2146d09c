"""Helpers for tests that run services as real processes: the Dynamo reference, when installed,
and kvrouter itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.support.kv_publisher import free_tcp_port

REFERENCE_MISSING = (
    "the Dynamo 1.6.1 reference is not installed (pip install ai-dynamo-runtime==1.6.1 in a venv and "
    "set KVROUTER_REFERENCE_PYTHON to its python)"
)


def reference_python() -> str | None:
    """A python with ``ai-dynamo-runtime`` importable: $KVROUTER_REFERENCE_PYTHON, or this one."""
    for python in (os.environ.get("KVROUTER_REFERENCE_PYTHON"), sys.executable):
        if (
            python
            and subprocess.run(
                [python, "-c", "import dynamo.slot_tracker"], capture_output=True, check=False
            ).returncode
            == 0
        ):
            return python
    return None


def require_reference() -> str:
    """Skip the calling test module (with the reason a user needs) unless the reference is there."""
    python = reference_python()
    if python is None:
        pytest.skip(REFERENCE_MISSING, allow_module_level=True)
    return python


def free_port() -> int:
    return free_tcp_port()


async def start_process(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> trio.Process:
    """Start ``argv`` (stderr to ``log``) and return once it accepts TCP connections on ``port``."""
    with log.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, **(env or {})}
        )
    with trio.fail_after(30):
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return process
            except OSError:
                if process.poll() is not None:
                    raise AssertionError(f"{argv[:3]} exited with {process.returncode}; see {log}") from None
                await trio.sleep(0.05)
