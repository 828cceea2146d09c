"""A cluster of three slot-tracker replicas (``--cluster``) on a real etcd and a real nats-server (JetStream), all on
free loopback ports and stopped by PID: a write sent to a replica that does not own its scope is forwarded to the
owner; the owner killed with kill -9, a survivor claims the scope once the owner's lease ends, recovers it from the
scope's own JetStream subject, and serves it, with every acknowledged booking; ``GET /cluster`` names the new
owner. A replica started without what ``--cluster`` needs, or unable to reach etcd, exits 2 with one line."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import ScopeKey
from tests.support.cluster import append_behind_the_owners_back, model_owned_by, scope_row, wait_for_members
from tests.support.fleet_servers import NatsServer, etcd_and_nats, nats_server, servers
from tests.support.processes import free_port
from tests.support.replicas import AUTH, CLUSTER, TTL_SECONDS, Replica, replicas

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats", "nats_server", "replicas", "servers"]  # fixtures (tests/support)


async def etcd_keys(etcd: str, key: str) -> int:
    """How many keys etcd holds at ``key`` now."""
    body = {"key": base64.b64encode(key.encode()).decode(), "count_only": True}
    async with httpx.AsyncClient(trust_env=False) as http:
        return int((await http.post(etcd + "/v3/kv/range", json=body)).json().get("count", 0))


async def test_a_forwarded_scope_survives_its_owner_killed_with_kill_9(
    replicas: list[Replica], servers: tuple[str, str]
) -> None:
    a, b, c = replicas
    model = model_owned_by(b.url, [r.url for r in replicas])
    register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}
    acknowledged: list[str] = []
    unknown: list[str] = []  # answered 504: forwarded to B as it died (it may have been applied there)

    async def add(http: httpx.AsyncClient, request_id: str) -> httpx.Response:
        body = {"model_name": model, "request_id": request_id, "worker_id": 1, "dp_rank": 1,
                "sequence_hashes": [1, 2, 3], "new_isl_tokens": 10}  # fmt: skip
        response = await http.post("/add", json=body)
        if response.status_code == 201:
            acknowledged.append(request_id)
        elif response.status_code == 504:  # the outcome is unknown, with a reason
            assert "outcome is unknown" in response.json()["error"], response.text
            unknown.append(request_id)
        else:  # while the scope moves: refused, not applied, with a reason
            assert response.status_code == 503 and "error" in response.json(), response.text
        return response

    async with httpx.AsyncClient(base_url=a.url, timeout=15, trust_env=False, headers=AUTH) as http:
        await wait_for_members(http, 3)
        assert (await http.post("/register", json=register)).status_code == 201  # through A, applied on B
        for n in range(5):
            assert (await add(http, f"r{n}")).status_code == 201
        row = await scope_row(http, model)
        assert row["owner"] == b.url and not row["served_here"]

        await b.kill9()
        killed = trio.current_time()
        with trio.fail_after(15):
            n = 5
            while (await add(http, f"r{n}")).status_code != 201:  # 503 until a survivor serves the scope
                n += 1
                await trio.sleep(0.05)
        failover = trio.current_time() - killed
        assert failover < 10, failover
        for later in range(n + 1, n + 4):
            assert (await add(http, f"r{later}")).status_code == 201
        body = {"model_name": model, "worker_id": 1, "dp_rank": 1, "sequence_hashes": [9], "new_isl_tokens": 10}
        commands = [{"method": "POST", "path": "/add", "body": {**body, "request_id": f"b{i}"}} for i in range(3)]
        row = await scope_row(http, model, lambda row: row["owner"] in (a.url, c.url))
        other = c if row["owner"] == a.url else a  # the survivor that does not own the scope
        async with httpx.AsyncClient(base_url=other.url, timeout=15, trust_env=False, headers=AUTH) as through_other:
            answers = (await through_other.post("/batch", json=commands)).json()  # forwarded write by write
        assert [answer["status"] for answer in answers] == [201, 201, 201], answers
        acknowledged.extend(f"b{i}" for i in range(3))

        view = (await http.get("/cluster")).json()
        assert b.url not in view["members"]
        samples = dict(
            line.rsplit(" ", 1) for line in (await http.get("/metrics")).text.splitlines() if line[:1] != "#"
        )
        assert float(samples["kvrouter_cluster_forwarded_total"]) >= 6  # A forwarded the register and 5 adds to B
        assert 0 < float(samples["kvrouter_cluster_lease_remaining_seconds"]) <= TTL_SECONDS
        row = await scope_row(http, model, lambda row: row["owner"] in (a.url, c.url))
        loads = (await http.get("/loads", params={"model_name": model})).json()
    async with httpx.AsyncClient(base_url=c.url, timeout=15, trust_env=False, headers=AUTH) as http:
        assert (await http.get("/loads", params={"model_name": model})).json() == loads
    tokens = {(row["worker_id"], row["dp_rank"]): row["active_prefill_tokens"] for row in loads}
    assert tokens[1, 0] == 0
    assert 10 * len(acknowledged) <= tokens[1, 1] <= 10 * (len(acknowledged) + len(unknown)), (tokens, unknown)

    # A clean stop (SIGTERM): the owner drains, closes the scope's journal and revokes its lease before it exits
    # (its keys are gone at once, not after the TTL), and the last replica takes the scope over with every
    # acknowledged booking.
    owner, last = (a, c) if row["owner"] == a.url else (c, a)
    assert owner.process is not None
    owner.process.send_signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await owner.process.wait() == 0
    members = f"kvrouter/cluster/{CLUSTER}/members/"
    assert await etcd_keys(servers[0], members + owner.url) == 0
    assert await etcd_keys(servers[0], members + last.url) == 1
    async with httpx.AsyncClient(base_url=last.url, timeout=15, trust_env=False, headers=AUTH) as http:
        with trio.fail_after(15):
            for attempt in range(1000):
                if (await add(http, f"after-stop-{attempt}")).status_code == 201:
                    break
                await trio.sleep(0.05)
        loads = (await http.get("/loads", params={"model_name": model})).json()
    assert [row["active_prefill_tokens"] for row in loads] == [0, 10 * len(acknowledged)]


async def test_a_paused_owner_loses_its_scope_and_forwards_to_the_new_owner_once_it_resumes(
    replicas: list[Replica],
) -> None:
    """SIGSTOP past the lease: another replica takes the scope; resumed, the old owner does not serve it (its lease
    ended on its own clock first), takes a new lease and joins again; placement prefers it for the scope, so the
    new owner hands the scope back to it cleanly, with every acknowledged booking."""
    a, b, c = replicas
    model = model_owned_by(b.url, [r.url for r in replicas])
    acknowledged = unknown = 0

    async def add(http: httpx.AsyncClient, request_id: str) -> int:
        nonlocal acknowledged, unknown
        body = {"model_name": model, "request_id": request_id, "worker_id": 1, "dp_rank": 0,
                "sequence_hashes": [7], "new_isl_tokens": 5}  # fmt: skip
        response = await http.post("/add", json=body)
        acknowledged += response.status_code == 201
        unknown += response.status_code == 504  # forwarded to the paused owner: it may land when it resumes
        if response.status_code != 201:  # while the scope moves: refused (not applied) or unknown, with a reason
            assert response.status_code in (503, 504) and "error" in response.json(), response.text
        return response.status_code

    async def until_acknowledged(http: httpx.AsyncClient, prefix: str) -> None:
        with trio.fail_after(15):
            for attempt in range(1000):
                if await add(http, f"{prefix}-{attempt}") == 201:
                    return
                await trio.sleep(0.05)

    register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    async with httpx.AsyncClient(base_url=a.url, timeout=15, trust_env=False, headers=AUTH) as http:
        await wait_for_members(http, 3)
        assert (await http.post("/register", json=register)).status_code == 201
        for n in range(3):
            assert await add(http, f"before-{n}") == 201
        assert b.process is not None
        os.kill(b.process.pid, signal.SIGSTOP)
        await until_acknowledged(http, "paused")  # a survivor took the scope over
        new_owner = (await scope_row(http, model, lambda row: row["owner"] in (a.url, c.url)))["owner"]
    os.kill(b.process.pid, signal.SIGCONT)
    async with httpx.AsyncClient(base_url=b.url, timeout=15, trust_env=False, headers=AUTH) as http:
        await until_acknowledged(http, "resumed")  # 503 while its view is stale, then forwarded or served
        assert (await http.get("/cluster")).json()["lease"]["live"]
        assert new_owner != b.url
        await scope_row(http, model, lambda row: row["owner"] == b.url and row["served_here"])  # handed back
        await until_acknowledged(http, "back")
        loads = (await http.get("/loads", params={"model_name": model})).json()
    [tokens] = [row["active_prefill_tokens"] for row in loads]
    assert 5 * acknowledged <= tokens <= 5 * (acknowledged + unknown)


async def test_a_fenced_append_drops_the_scope_and_the_next_command_recovers_it(
    tmp_path: Path, servers: tuple[str, str]
) -> None:
    """Another writer appends to a scope's subject behind its owner's back: the owner's next append is refused by
    JetStream (503, not applied), the owner drops the scope, and the next command recovers it from the subject,
    the other writer's record included."""
    etcd, nats = servers
    owner = Replica(tmp_path, "owner", etcd, nats)
    await owner.start()
    scope = ScopeKey("m", "default")
    try:
        async with httpx.AsyncClient(base_url=owner.url, timeout=15, trust_env=False, headers=AUTH) as http:
            register = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}
            assert (await http.post("/register", json=register)).status_code == 201
            add = {"model_name": "m", "worker_id": 1, "dp_rank": 1, "sequence_hashes": [1], "new_isl_tokens": 10}
            assert (await http.post("/add", json={**add, "request_id": "r0"})).status_code == 201
            await append_behind_the_owners_back(nats, scope, RequestAdded("foreign", 1, 0, (5,), 7, 1))
            refused = await http.post("/add", json={**add, "request_id": "r1"})
            assert refused.status_code == 503 and "error" in refused.json(), refused.text
            with trio.fail_after(15):
                for _ in range(1000):
                    if (await http.post("/add", json={**add, "request_id": "r1"})).status_code == 201:
                        break
                    await trio.sleep(0.05)
            loads = (await http.get("/loads")).json()
        assert [row["active_prefill_tokens"] for row in loads] == [7, 20]  # the foreign record, then r0 and r1
        assert "dropped" in owner.log.read_text()
    finally:
        await owner.kill9()


def test_a_replica_without_what_cluster_needs_exits_2_in_one_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", "0"]
    argv += ["--data-dir", str(tmp_path / "data"), "--cluster", "C"]
    env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--etcd-endpoints" in lines[0] and "--advertise-url" in lines[0], result.stderr


async def test_a_replica_that_cannot_reach_etcd_exits_2_naming_it(tmp_path: Path, nats_server: NatsServer) -> None:
    etcd = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", "0", "--data-dir",
            str(tmp_path / "data"), "--cluster", "C", "--etcd-endpoints", etcd, "--nats-server", nats_server.url,
            "--advertise-url", "http://127.0.0.1:1"]  # fmt: skip
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and f"cannot reach etcd at {etcd}" in lines[0], lines


def test_a_replica_that_cannot_reach_nats_exits_2_naming_it(tmp_path: Path) -> None:
    nats = f"nats://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", "0", "--data-dir",
            str(tmp_path / "data"), "--cluster", "C", "--etcd-endpoints", "http://127.0.0.1:1", "--nats-server", nats,
            "--advertise-url", "http://127.0.0.1:1"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach NATS at {nats}" in lines[0], result.stderr


@pytest.mark.parametrize(
    ("service", "flags", "names"),
    [
        ("slot-tracker", ["--advertise-url", "http://127.0.0.1:8001/some/path"], "--advertise-url"),
        ("select-service", ["--advertise-url", "http://u:p@127.0.0.1:8001"], "--advertise-url"),
        ("slot-tracker", ["--advertise-url", "http://127.0.0.1:8001", "--journal", "file"], "--journal file"),
        ("select-service", ["--advertise-url", "http://127.0.0.1:8001", "--durability", "off"], "--durability off"),
    ],
)
def test_a_replica_with_a_bad_advertise_url_or_an_ignored_journal_flag_exits_2_in_one_line(
    tmp_path: Path, service: str, flags: list[str], names: str
) -> None:
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", service, "--port", "0", "--data-dir", str(tmp_path / "d")]
    argv += ["--cluster", "C", "--etcd-endpoints", "http://127.0.0.1:1", "--nats-server", "nats://127.0.0.1:1"]
    result = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in result.stderr, result.stderr
