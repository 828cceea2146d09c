"""Helpers for tests that run services as real processes: the Dynamo reference, when installed,
and kvrouter itself (``KvrouterProcess``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
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


class KvrouterProcess:
    """A kvrouter process (``argv``, serving on ``port`` of 127.0.0.1, its stderr appended to ``NAME.log`` in
    ``directory``): ``start`` returns once ``GET /health`` answers 200, ``kill9`` ends it by its PID."""

    def __init__(self, directory: Path, name: str, argv: list[str], port: int) -> None:
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = directory / f"{name}.log"
        self.process: trio.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(self.argv, stdout=subprocess.DEVNULL, stderr=log)
        async with httpx.AsyncClient(base_url=self.url, trust_env=False) as http:
            with trio.fail_after(30):
                while True:
                    if self.process.poll() is not None:
                        raise AssertionError(self.log.read_text())
                    try:
                        if (await http.get("/health")).status_code == 200:
                            return
                    except httpx.TransportError:
                        await trio.sleep(0.05)

    async def kill9(self) -> None:
        if self.process is not None and self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGKILL)
            await self.process.wait()
