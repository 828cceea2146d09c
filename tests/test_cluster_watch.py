"""``kvrouter watch URL --cluster`` as a user runs it (a subprocess) against a real cluster (etcd, a nats-server with
JetStream, two ``--cluster`` replicas, all on free loopback ports and stopped by PID): it prints the replica's
members and owners, then a line when a scope moves (here: its owner stopped with SIGTERM hands it over) and when a
member leaves. Its failures are one line: exit 1 for a replica it cannot reach, exit 2 for flags that do not
combine."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.placement import preferred_owner
from kvrouter.api.cli.watch_cluster import change_line
from tests.api.test_watch import Lines
from tests.support.cluster import client, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.processes import free_port
from tests.support.replicas import Replica, pair

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats", "pair", "servers"]  # fixtures (tests/support)

WATCH = [sys.executable, "-m", "kvrouter.api.cli.main", "watch"]


async def owner_change(lines: Lines, model: str) -> dict[str, Any]:
    while True:
        line = await lines.next()
        if line["type"] == "owner" and line["model_name"] == model:
            return line


async def test_watch_cluster_shows_a_scope_moving_to_its_new_owner(tmp_path: Path, pair: list[Replica]) -> None:
    a, b = pair
    model = next(
        f"m{n}"
        for n in range(1000)
        if preferred_owner(scope_token(ScopeKey(f"m{n}", "default")), sorted([a.url, b.url])) == a.url
    )
    async with client(b) as on_b:
        await wait_for_members(on_b, 2)
        register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await on_b.post("/register", json=register)).status_code == 201
    argv = [*WATCH, b.url, "--cluster", "--json", "--token-file", str(tmp_path / "token")]
    process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
    try:
        lines = Lines(process)
        with trio.fail_after(10):
            assert (await lines.next())["type"] == "cluster"
            seen = [await lines.next(), await lines.next()]  # the members, as the first answer shows them
            assert {(line["member"], line["joined"]) for line in seen} == {(a.url, True), (b.url, True)}
            first = await owner_change(lines, model)
            assert (first["from"], first["to"]) == (None, a.url)
        assert a.process is not None
        a.process.send_signal(signal.SIGTERM)
        stopped = trio.current_time()
        with trio.fail_after(15):
            moves = [await owner_change(lines, model)]
            while moves[-1]["to"] != b.url:  # one line, or two if a poll fell between release and claim
                moves.append(await owner_change(lines, model))
        seen_after = trio.current_time() - stopped
        assert moves[0]["from"] == a.url, moves
        assert moves[-1]["at"] >= first["at"]
        assert await a.process.wait() == 0
        with trio.fail_after(10):
            while True:
                line = await lines.next()
                if line["type"] == "member":
                    break
        assert (line["member"], line["joined"]) == (a.url, False)
    finally:
        process.send_signal(signal.SIGINT)
        with trio.fail_after(10):
            assert await process.wait() == 0  # Ctrl-C: exit 0
    print(f"the move was shown {seen_after:.2f} s after SIGTERM: {[change_line(move) for move in moves]}")


def test_watch_cluster_lines_as_printed() -> None:
    move = {"type": "owner", "at": 0.25, "model_name": "llama", "tenant_id": "default", "token": "t",
            "from": "http://127.0.0.1:8091", "to": None}  # fmt: skip
    assert change_line(move).endswith(".250 llama/default: http://127.0.0.1:8091 -> (no owner)")
    member = {"type": "member", "at": 1.0, "member": "http://127.0.0.1:8092", "joined": True}
    assert change_line(member).endswith(".000 member http://127.0.0.1:8092 joined")


def test_watch_cluster_failures_are_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    gone = subprocess.run([*WATCH, url, "--cluster"], capture_output=True, text=True, timeout=30)
    assert (gone.returncode, gone.stderr.count("\n")) == (1, 1), gone.stderr
    assert f"cannot reach {url}" in gone.stderr
    both = subprocess.run([*WATCH, url, "--cluster", "--decisions"], capture_output=True, text=True, timeout=30)
    assert (both.returncode, both.stderr.count("\n")) == (2, 1), both.stderr
    assert "do not combine" in both.stderr
