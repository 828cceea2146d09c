"""Helpers the benchmark scripts share: ports, process memory, starting kvrouter's selection service, and
finding the Dynamo reference."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def reference_python(explicit: str | None, module: str) -> str | None:
    """A python that can import ``module`` (e.g. ``dynamo.slot_tracker``): ``explicit`` if given,
    else $KVROUTER_REFERENCE_PYTHON, else this interpreter."""
    candidates = [explicit] if explicit else [os.environ.get("KVROUTER_REFERENCE_PYTHON"), sys.executable]
    for python in candidates:
        if (
            python
            and subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False).returncode == 0
        ):
            return python
    return None


def repo_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH, so a started service runs this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def select_service_argv(
    port: int, data: Path, *, durability: str | None = None, log_level: str = "warning", fresh: bool = True
) -> list[str]:
    """The command line of kvrouter's selection service on ``port`` with its journal in ``data``."""
    argv = [sys.executable, "-m", "kvrouter.api.select_service", "--port", str(port), "--data-dir", str(data)]
    if durability is not None:
        argv += ["--durability", durability]
    argv += ["--log-level", log_level]
    if fresh:
        argv.append("--fresh")
    return argv
