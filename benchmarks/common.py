"""Helpers both benchmark scripts use: ports, process memory, and finding the Dynamo reference."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


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
