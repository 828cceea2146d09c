"""Against Dynamo 1.6.1 itself (optional): ``dynamo.mocker`` discovered from etcd, a prompt sent through
``dynamo.frontend`` shows the mocker's cached blocks in kvrouter's ``/select`` on the NATS and the ZMQ plane, a
restarted kvrouter catches up through JetStream, a booking the mocker's KV events leave unanswered takes it out of
kvrouter's selection within the timeout (and a prompt brings it back), and the mocker killed with -9 leaves the
catalog within its lease TTL + 2 s.

Skipped unless a throw-away venv with Dynamo exists (docs/fleet.md, "Testing against Dynamo"):
``$KVROUTER_DYNAMO_PYTHON``, or ``../dynvenv`` or ``../refvenv`` beside the repository (``support/dynamo_venv.py``).
The stack runs inside a network namespace (``unshare -n``): Dynamo's ZMQ publishers bind 0.0.0.0 whatever they are
told.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dynamo_venv import dynamo_python
from tests.support.fleet_servers import ETCD, NATS_SERVER

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("dynamo_stack.py")


def isolated() -> list[str]:
    """The command prefix that runs the stack in a network namespace of its own, with loopback up."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True, check=False).returncode:
        pytest.skip("cannot make a network namespace (unshare -n needs root or user namespaces)")
    return [unshare, "-n", "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$0" "$@"']


@pytest.mark.parametrize("plane", ["nats", "zmq"])
def test_dynamo_workers_are_discovered_and_their_kv_events_indexed(plane: str, tmp_path: Path) -> None:
    python = dynamo_python()
    if ETCD is None or NATS_SERVER is None:
        pytest.skip("etcd and nats-server are needed (apt-get install etcd-server nats-server)")
    argv = [
        *isolated(),
        sys.executable,
        str(DRIVER),
        "--dynamo-python",
        python,
        "--plane",
        plane,
        "--workdir",
        str(tmp_path),
        "--etcd",
        ETCD,
        "--nats-server",
        NATS_SERVER,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (worker,) = result["discovered"]
    assert (worker["model_name"], worker["block_size"], worker["discovered_by"]) == ("tiny", 16, "etcd")
    cached_by_dynamo = result["dynamo_cached_tokens"][1]
    assert cached_by_dynamo > 0
    select = result["select"]
    assert select["worker_id"] == worker["worker_id"]
    assert select["overlap"]["dp"]["0"] == cached_by_dynamo  # kvrouter sees what Dynamo's own router counted
    assert result["kv_listener"]["lost_batches"] == 0
    if plane == "nats":
        assert result["kv_listener"]["plane"] == "jetstream"
        assert result["select_after_restart"]["overlap"]["dp"]["0"] > 0  # published while kvrouter was down
    live = result["liveness"]  # a booking its KV events leave unanswered: out within the timeout, back at a prompt
    assert live["out"]["reason"] == "kv_events_stopped"
    assert live["out_after_seconds"] <= result["kv_events_timeout_seconds"] * 1.25 + 1
    assert 'kvrouter_kv_stream_returns_total{cause="kv_events_resumed"} 1.0' in live["metrics"]
    assert result["left_after_kill_seconds"] <= result["lease_ttl_seconds"] + 2
