"""Faults on real processes, Jepsen style (``simulations/process_faults``): etcd, a 3-node NATS cluster (R=3) and
3 slot-tracker replicas with ``--cluster``, each in a network namespace of its own behind a bridge; 4 clients in
this namespace book, complete and free requests and register workers through random replicas while a nemesis
partitions the processes (random sides, every path between them cut), kills (SIGKILL, then starts again) and
pauses (SIGSTOP, then SIGCONT) replicas, NATS nodes and etcd. After healing, the ownership simulation's checker
over the history and the truth read from each scope's JetStream subject: every acknowledged booking not possibly
freed is there, none was acknowledged twice, each worker's load is the sum of its live bookings, and every replica
answers ``/loads`` as the truth within 10 s of the last fault, or of the stream having a leader again if that is
later (nats-server takes several seconds to elect one after losing its leader).

The network itself is tested first: a cut loses packets both ways and only between its sides, a heal restores
them, and the namespaces and bridge are gone afterwards, also after a failure and after a run that died. Skips
(with the reason) where namespaces cannot be made (not root, no ``ip``) or etcd or nats-server is missing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrouter.simulations.process_faults.network import Host, Network, clean_leftovers, network_missing
from kvrouter.simulations.process_faults.run import RunOptions, run_faults, servers_missing
from kvrouter.simulations.process_faults.servers import stop

pytestmark = pytest.mark.slow

PORT = 7070
SERVE = f"""
import socket, sys
server = socket.create_server((sys.argv[1], {PORT}))
while True:
    connection, _ = server.accept()
    connection.sendall(b"hi")
    connection.close()
"""
REACH = f"""
import socket, sys
assert socket.create_connection((sys.argv[1], {PORT}), timeout=1).recv(2) == b"hi"
"""


@pytest.fixture
def namespaces_possible() -> None:
    missing = network_missing()
    if missing is not None:
        pytest.skip(missing)


def reaches(source: Host | None, target: Host) -> bool:
    """Whether a connection from ``source``'s namespace (None: this one) to ``target``'s server is answered."""
    argv = [sys.executable, "-c", REACH, target.address]
    done = subprocess.run(argv if source is None else source.wrap(argv), capture_output=True, timeout=10)
    return done.returncode == 0


def wait_listening(target: Host) -> None:
    deadline = time.monotonic() + 10
    while not reaches(None, target):
        assert time.monotonic() < deadline, f"nothing listened at {target.address}"
        time.sleep(0.1)


def leftovers(run: str) -> list[str]:
    """The namespaces and links named after ``run`` that exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    ours = re.compile(rf"^{run}(?:-|[hp]\d|$)")
    return [word for word in (names + links).replace(":", " ").replace("@", " ").split() if ours.match(word)]


@pytest.mark.usefixtures("namespaces_possible")
def test_a_cut_loses_packets_between_its_sides_only_and_a_heal_restores_them() -> None:
    with Network(["x", "y", "z"]) as network:
        x, y, z = (network.hosts[name] for name in "xyz")
        server = subprocess.Popen(y.wrap([sys.executable, "-c", SERVE, y.address]))
        try:
            wait_listening(y)
            assert reaches(x, y) and reaches(z, y)
            network.cut(["x"], ["y", "z"])
            assert not reaches(x, y)
            assert reaches(z, y) and reaches(None, y)  # other paths, and the clients' namespace, are not cut
            network.heal()
            assert reaches(x, y)
        finally:
            stop(server)
    assert leftovers(network.run) == []


@pytest.mark.usefixtures("namespaces_possible")
def test_the_network_is_deleted_after_a_failure_and_a_dead_runs_leftovers_at_the_next_start() -> None:
    with pytest.raises(RuntimeError), Network(["x"]) as network:
        raise RuntimeError("the run failed")
    assert leftovers(network.run) == []
    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID names the leftovers of a run that died without deleting them
    run = f"kvf{dead.pid}"
    subprocess.run(["ip", "netns", "add", f"{run}-x"], check=True)
    subprocess.run(["ip", "link", "add", run, "type", "bridge"], check=True)
    assert sorted(clean_leftovers()) == sorted([f"{run}-x", run])
    assert leftovers(run) == []


@pytest.mark.usefixtures("namespaces_possible")
async def test_acknowledged_writes_survive_partitions_kills_and_pauses_and_replicas_agree(tmp_path: Path) -> None:
    missing = servers_missing()
    if missing is not None:
        pytest.skip(missing)
    result = await run_faults(tmp_path, RunOptions(seed=7, fault_seconds=25.0))
    assert result.violations == [], f"history: {result.history}"
    assert result.led_after is not None and result.agreed_after is not None
    assert result.agreed_after <= max(result.led_after, 0.0) + 10.0
    assert result.operations["ok"] > 100  # the clients got through the faults
    assert result.faults["partition"] >= 2 and sum(result.faults.values()) >= 5
