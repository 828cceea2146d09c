"""Run one chain of documentation examples: ``python doc_example_runner.py CHAIN.json``.

Started by tests/docs/test_docs_examples.py, inside a network namespace of its own when the machine allows it
(``unshare --net``), so it uses the standard library only and brings the namespace's loopback up itself. The
JSON names the working directory and the blocks (code, background ports, whether errors are expected). Each block
runs in a process group of its own, so that everything a block started, in the background or with ``&``, is
stopped by that group when the chain ends (SIGTERM, then SIGKILL after a grace period). Exit status 0 when every
block passed; the output tells what each block printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PORT_WAIT_SECONDS = 30.0  # a service start is ~2 s on a busy 2-core machine
BLOCK_SECONDS = 60.0
STOP_GRACE_SECONDS = 10.0


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec["own_network"]:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    workdir = spec["workdir"]
    groups: list[subprocess.Popen[bytes]] = []
    try:
        for number, block in enumerate(spec["blocks"], 1):
            header = f"--- block {number}: {block['where']}"
            if block["ports"]:
                ok = start_in_background(block, workdir, groups, header)
            else:
                ok = run_in_foreground(block, workdir, groups, header)
            if not ok:
                return 1
        return 0
    finally:
        stop(groups)


def run_in_foreground(block: dict, workdir: str, groups: list[subprocess.Popen[bytes]], header: str) -> bool:
    process = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", block["code"]],
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    groups.append(process)
    try:
        output, _ = process.communicate(timeout=BLOCK_SECONDS)
    except subprocess.TimeoutExpired:
        stop([process])
        output, _ = process.communicate()
        print(f"{header}: still running after {BLOCK_SECONDS:.0f} s\n{output.decode(errors='replace')}")
        return False
    text = output.decode(errors="replace")
    print(f"{header} (exit {process.returncode})\n{text}", flush=True)
    if process.returncode != 0:
        print(f"{header}: FAILED, exit status {process.returncode}")
        return False
    if '{"error"' in text.replace(" ", "") and not block["errors"]:
        print(f"{header}: FAILED, it printed an error body; mark it 'errors' if that is what it shows")
        return False
    return True


def start_in_background(block: dict, workdir: str, groups: list[subprocess.Popen[bytes]], header: str) -> bool:
    log = Path(workdir) / f".docs-test-background-{len(groups)}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["bash", "-c", block["code"]],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    groups.append(process)
    deadline = time.monotonic() + PORT_WAIT_SECONDS
    waiting = list(block["ports"])
    while waiting:
        if process.poll() is not None:
            print(f"{header}: FAILED, exited ({process.returncode}) before listening on {waiting}")
            print(log.read_text(errors="replace"))
            return False
        if time.monotonic() > deadline:
            print(f"{header}: FAILED, nothing listening on {waiting} after {PORT_WAIT_SECONDS:.0f} s")
            print(log.read_text(errors="replace"))
            return False
        if listening(waiting[0]):
            waiting.pop(0)
        else:
            time.sleep(0.05)
    print(f"{header}: started in the background, listening on {block['ports']}", flush=True)
    return True


def listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop(groups: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every group still there (the services shut down gracefully), then SIGKILL what outlives the grace."""
    alive = [process.pid for process in reversed(groups) if signal_group(process.pid, signal.SIGTERM)]
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in groups:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    while alive and time.monotonic() < deadline:
        alive = [pgid for pgid in alive if signal_group(pgid, 0)]
        time.sleep(0.05)
    for pgid in alive:
        signal_group(pgid, signal.SIGKILL)


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to the process group; False when no process of it is left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
