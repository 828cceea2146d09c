"""Faults on real processes, Jepsen style (``simulations/process_faults``): etcd, a 3-node NATS cluster (R=3) and
3 slot-tracker replicas with ``--cluster`` on free loopback ports; 4 clients book, complete and free requests and
register workers through random replicas while a nemesis kills (SIGKILL, then starts again) and pauses (SIGSTOP,
then SIGCONT) replicas and NATS nodes. After healing, the ownership simulation's checker over the history and the
truth read from each scope's JetStream subject: every acknowledged booking not possibly freed is there, none was
acknowledged twice, each worker's load is the sum of its live bookings, and every replica answers ``/loads`` as the
truth within 10 s of the last fault. Skips when etcd or nats-server is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter.simulations.process_faults.run import RunOptions, run_faults, servers_missing

pytestmark = pytest.mark.slow


async def test_acknowledged_writes_survive_kills_and_pauses_and_replicas_agree(tmp_path: Path) -> None:
    missing = servers_missing()
    if missing is not None:
        pytest.skip(missing)
    result = await run_faults(tmp_path, RunOptions(seed=7, fault_seconds=25.0))
    assert result.violations == [], f"history: {result.history}"
    assert result.agreed_after is not None and result.agreed_after <= 10.0
    assert result.operations["ok"] > 100  # the clients got through the faults
    assert sum(result.faults.values()) >= 5
