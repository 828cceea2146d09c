"""A cluster of three selection-service replicas (``select-service --cluster``) on a real etcd and nats-server, on
free loopback ports, stopped by PID: a worker registered through one replica, its KV events (ZMQ) taken by the
scope's owner alone, a selection through another replica shows the overlap; the owner killed with kill -9, a
survivor serves the scope with its KV index restored from the scope's subject, the same overlap, the reservations
booked before the kill, and the worker's events still followed; events published while no replica owns the scope
are replayed by the worker to the next owner. ``POST /batch`` sends each command where it is served; concurrent
selections through a replica that does not own their scope reach the owner in shared batches. A replica
of another service kind than the cluster's, and flags a selection-service replica cannot run with, are refused
in one line (exit 2)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.client.live import open_stream, stream_url
from kvrouter.journal.jetstream_batch import FORMAT
from tests.support.cluster import client, figures, model_owned_by, scope_row, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.kv_publisher import KvPublisher, open_kv_publisher
from tests.support.processes import free_port
from tests.support.replicas import AUTH, CLUSTER, TOKEN, Replica, SelectReplica, running, select_replicas

pytestmark = pytest.mark.slow
__all__ = ["etcd_and_nats", "select_replicas", "servers"]  # fixtures (tests/support)

TOKENS = list(range(64))


def worker_record(worker_id: int, model: str, publisher: KvPublisher) -> dict[str, object]:
    """A worker of ``model`` (blocks of 4 tokens) whose KV events ``publisher`` publishes."""
    return {"worker_id": worker_id, "model_name": model, "endpoint": f"http://w{worker_id}", "block_size": 4,
            "kv_events_endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}  # fmt: skip


async def device_blocks(http: httpx.AsyncClient, model: str, wanted: int) -> None:
    """``POST /overlap_scores`` until the worker's device blocks are ``wanted`` (503 while the scope moves)."""
    with trio.fail_after(20):
        while True:
            answer = await http.post("/overlap_scores", json={"model_name": model, "token_ids": TOKENS})
            if answer.status_code == 200:
                workers = answer.json()["workers"]
                if workers and workers[0]["device_blocks"] == wanted:
                    return
            else:  # while the scope moves: refused (503), or unknown (504: asked of the owner as it died)
                assert answer.status_code in (503, 504) and "error" in answer.json(), answer.text
            await trio.sleep(0.05)


async def test_the_kv_index_of_a_scope_survives_its_owner_killed_with_kill_9(
    select_replicas: list[SelectReplica],
) -> None:
    a, b, c = select_replicas
    model = model_owned_by(b.url, [r.url for r in select_replicas])
    async with open_kv_publisher() as publisher, client(a) as through_a, client(c) as through_c:
        await wait_for_members(through_a, 3)
        assert (await through_a.post("/workers", json=worker_record(3, model, publisher))).status_code == 201  # on B
        row = await scope_row(through_a, model)
        assert row["owner"] == b.url and not row["served_here"]
        publisher.publish(encode_batch([["BlockStored", [1, 2, 3, 4], None, TOKENS[:16], 4, None, None]]))
        await device_blocks(through_c, model, 4)  # B took the events; asked through C
        query = {"model_name": model, "token_ids": TOKENS}
        selected = (await through_c.post("/select", json=query)).json()
        assert (selected["worker_id"], selected["overlap"]["gpu"]) == (3, 16), selected  # 4 blocks of 4 tokens
        booked = (await through_c.post("/select_and_reserve", json={**query, "reservation_id": "kept"})).json()
        assert booked["reservation_id"] == "kept"
        gone = await through_c.post("/select_and_reserve", json={**query, "reservation_id": "gone"})
        assert gone.status_code == 200
        assert (await through_a.delete("/reservations/gone")).status_code == 200  # found on B, through A
        assert (await through_a.delete("/reservations/gone")).status_code == 404
        commands = [{"method": "POST", "path": "/select_and_reserve", "body": {**query, "reservation_id": "batched"}},
                    {"method": "DELETE", "path": "/reservations/batched"}]  # fmt: skip
        answers = (await through_a.post("/batch", json=commands)).json()  # each command sent where it is served
        assert [answer["status"] for answer in answers] == [200, 200], answers
        workers = (await through_c.get("/workers")).json()
        assert [(w["worker_id"], w["model_name"]) for w in workers] == [(3, model)]
        assert (await through_a.get("/ready")).json()["schedulable_workers"] == 1
        assert list((await through_a.get("/dump")).json()) == [f"{model}:default"]
        patched = await through_c.patch("/workers/3", json={"max_num_batched_tokens": 4096})  # found on B
        assert patched.status_code == 200 and patched.json()["max_num_batched_tokens"] == 4096, patched.text
        assert (await through_c.patch("/workers/4", json={"max_num_batched_tokens": 1})).status_code == 404
        watch = await through_a.get("/ws/decisions")
        assert watch.status_code == 501 and "error" in watch.json(), watch.text
        async with open_stream(stream_url(b.url, "/ws/loads"), token=TOKEN) as ws:  # the scopes B serves
            snapshot = orjson.loads(await ws.get_message())
        assert [(p["model_name"], [r["worker_id"] for r in p["loads"]]) for p in snapshot["scopes"]] == [(model, [3])]
        assert "kvrouter_cluster_scopes_served" in (await through_c.get("/metrics")).text
        await trio.sleep(1)  # the KV events' records are published with the next group (nobody waits for them)

        await b.kill9()
        await device_blocks(through_a, model, 4)  # a survivor claimed the scope and restored its index
        row = await scope_row(through_a, model, lambda row: row["owner"] in (a.url, c.url))
        after = (await through_a.post("/select", json=query)).json()
        assert (after["worker_id"], after["overlap"]) == (3, selected["overlap"]), after
        assert (await through_c.post("/reservations/kept/prefill_complete")).status_code == 200
        assert (await through_c.delete("/reservations/kept")).status_code == 200
        # The new owner follows the worker's events (its listener resumed after the journaled watermark).
        publisher.publish(encode_batch([["BlockStored", [5, 6, 7, 8], 4, TOKENS[16:32], 4, None, None]]))
        await device_blocks(through_c, model, 8)
        await trio.sleep(1)

        # Events published while no replica owns the scope: the next owner asks the worker to replay them.
        owner, last = (a, c) if row["owner"] == a.url else (c, a)
        await owner.kill9()
        publisher.publish(encode_batch([["BlockStored", [9, 10, 11, 12], 8, TOKENS[32:48], 4, None, None]]))
        async with client(last) as through_last:
            await device_blocks(through_last, model, 12)
            assert [w["worker_id"] for w in (await through_last.get("/workers")).json()] == [3]
            assert (await scope_row(through_last, model, lambda row: row["owner"] == last.url))["served_here"]


def run_select_replica(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "select-service", "--port", "0", *arguments]
    env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)


def test_flags_a_selection_service_replica_cannot_run_with_are_refused_in_one_line(tmp_path: Path) -> None:
    cluster = ["--data-dir", str(tmp_path / "data"), "--cluster", "C", "--etcd-endpoints", "http://127.0.0.1:1",
               "--nats-server", "nats://127.0.0.1:1", "--advertise-url", "http://127.0.0.1:1"]  # fmt: skip
    for extra, named in (
        (["--indexer-peers", "http://127.0.0.1:2"], "--indexer-peers"),
        (["--discovery-backend", "file", "--discovery-file", str(tmp_path / "w.yaml")], "discovery"),
        (["--fronts", "2"], "--fronts"),
        (["--replica-sync-port", str(free_port())], "replica sync"),
    ):
        result = run_select_replica([*cluster, *extra])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and named in lines[0], result.stderr
    result = run_select_replica(["--data-dir", str(tmp_path / "data"), "--cluster", "C"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--etcd-endpoints" in lines[0], result.stderr


async def test_a_replica_of_another_service_kind_is_refused_at_join(tmp_path: Path, servers: tuple[str, str]) -> None:
    etcd, nats = servers
    slot = Replica(tmp_path, "slot", etcd, nats)
    await slot.start()
    try:
        joining = SelectReplica(tmp_path, "select", etcd, nats)
        result = await trio.run_process(joining.argv, capture_stdout=True, capture_stderr=True, check=False)
    finally:
        await slot.kill9()
    lines = [line for line in result.stderr.decode().strip().splitlines() if " INFO " not in line]  # --log-level info
    assert result.returncode == 2, lines
    assert len(lines) == 1 and f"cluster {CLUSTER} is a slot-tracker cluster" in lines[0], lines
    assert "this replica is a select-service" in lines[0], lines


async def test_a_joining_replica_takes_its_scope_with_the_index_and_the_workers_events(
    tmp_path: Path, servers: tuple[str, str]
) -> None:
    """Placement gives the scope to a replica that joins: the owner hands it over (its listeners stop with it), the
    new owner recovers the index from the subject and follows the worker's events from there; stopped with
    SIGTERM, it hands the scope on with the index."""
    a, b, c = (SelectReplica(tmp_path, name, *servers) for name in ("a", "b", "c"))
    model = model_owned_by(c.url, [a.url, b.url, c.url])
    try:
        await a.start()
        await b.start()
        async with open_kv_publisher() as publisher, client(a) as through_a:
            await wait_for_members(through_a, 2)
            assert (await through_a.post("/workers", json=worker_record(5, model, publisher))).status_code == 201
            first = (await scope_row(through_a, model))["owner"]
            publisher.publish(encode_batch([["BlockStored", [1, 2, 3, 4], None, TOKENS[:16], 4, None, None]]))
            await device_blocks(through_a, model, 4)
            await trio.sleep(1)  # the KV events' records are published with the next group

            await c.start()
            row = await scope_row(through_a, model, lambda row: row["owner"] == c.url)
            assert first != c.url and not row["served_here"]
            await device_blocks(through_a, model, 4)  # restored on C from the subject
            publisher.publish(encode_batch([["BlockStored", [5, 6, 7, 8], 4, TOKENS[16:32], 4, None, None]]))
            await device_blocks(through_a, model, 8)  # C follows the worker's events
            async with client(c) as through_c:
                assert (await scope_row(through_c, model))["served_here"]
                listeners = (await through_c.get("/workers")).json()[0]["kv_listeners"]
                assert listeners["0"]["state"] == "active", listeners
            assert c.process is not None  # stopped with SIGTERM: it hands the scope over before it exits
            c.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await c.process.wait() == 0
            await scope_row(through_a, model, lambda row: row["owner"] in (a.url, b.url))
            await device_blocks(through_a, model, 8)
    finally:
        for replica in (a, b, c):
            await replica.kill9()


async def test_a_replica_of_another_journal_format_is_refused_at_join(tmp_path: Path, servers: tuple[str, str]) -> None:
    etcd, nats = servers
    assert FORMAT != "0"
    held = orjson.dumps({"service": "select-service", "journal": "0"})  # as a build of another layout wrote it
    body = {"key": base64.b64encode(f"kvrouter/cluster/{CLUSTER}/service".encode()).decode(),
            "value": base64.b64encode(held).decode()}  # fmt: skip
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (await http.post(etcd + "/v3/kv/put", json=body)).status_code == 200
    joining = SelectReplica(tmp_path, "select", etcd, nats)
    result = await trio.run_process(joining.argv, capture_stdout=True, capture_stderr=True, check=False)
    lines = [line for line in result.stderr.decode().strip().splitlines() if " INFO " not in line]
    assert result.returncode == 2, lines
    assert len(lines) == 1 and "journal format 0" in lines[0] and f"journal format {FORMAT}" in lines[0], lines


async def test_concurrent_selections_through_a_non_owner_share_batches(select_replicas: list[SelectReplica]) -> None:
    """Selections that book, sent at once through a replica that does not own their scope, travel to the owner
    as commands of a few unordered ``POST /batch`` requests; each is answered as the owner answers it."""
    a, b, _ = select_replicas
    model = model_owned_by(b.url, [r.url for r in select_replicas])
    count = 120
    statuses: list[int] = []
    booked: list[str] = []
    limits = httpx.Limits(max_connections=48)
    async with (
        open_kv_publisher() as publisher,
        client(a) as through_a,
        httpx.AsyncClient(base_url=a.url, timeout=30, trust_env=False, headers=AUTH, limits=limits) as many,
    ):
        await wait_for_members(through_a, 3)
        assert (await through_a.post("/workers", json=worker_record(1, model, publisher))).status_code == 201
        dup = {"model_name": model, "token_ids": TOKENS[:4], "reservation_id": "dup"}
        assert (await through_a.post("/select_and_reserve", json=dup)).status_code == 200
        again = await through_a.post("/select_and_reserve", json=dup)
        assert again.status_code == 409 and "error" in again.json(), again.text  # the owner's answer, relayed
        assert (await through_a.delete("/reservations/dup")).status_code == 200
        before = await figures(through_a)

        async def select_and_reserve(n: int) -> None:
            body = {"model_name": model, "token_ids": TOKENS[: 4 + n % 32], "reservation_id": f"r{n}"}
            answer = await many.post("/select_and_reserve", json=body)
            statuses.append(answer.status_code)
            booked.append(answer.json().get("reservation_id", answer.text))

        async with trio.open_nursery() as nursery:
            for n in range(count):
                nursery.start_soon(select_and_reserve, n)
        after = await figures(through_a)
        # Booked through A: A sends each reservation's release to its scope's owner (B) alone, not to every member.
        released = [(await through_a.delete(f"/reservations/r{n}")).status_code for n in range(count)]
        settled = await figures(through_a)
        missing = await through_a.delete("/reservations/r0")  # released: B answers 404, then every member does
    assert statuses == [200] * count and sorted(booked) == sorted(f"r{n}" for n in range(count))
    batches = after["kvrouter_cluster_forward_batches_total"] - before["kvrouter_cluster_forward_batches_total"]
    carried = (
        after["kvrouter_cluster_forward_batched_writes_total"] - before["kvrouter_cluster_forward_batched_writes_total"]
    )
    assert carried == count and 0 < batches < count, (batches, carried)
    assert released == [200] * count
    assert (
        after["kvrouter_cluster_booked_reservations"] == count and settled["kvrouter_cluster_booked_reservations"] == 0
    )
    sent = settled["kvrouter_cluster_forwarded_total"] - after["kvrouter_cluster_forwarded_total"]
    assert sent == count, sent  # one request each, to B (asking every member would have sent two)
    assert missing.status_code == 404 and "error" in missing.json(), missing.text


async def test_a_forwarded_request_is_answered_as_the_owner_answers_it_alone(
    tmp_path: Path, servers: tuple[str, str]
) -> None:
    """What other clients' commands in the same forwarded batch must not change: a read whose answers together
    pass the owner's --max-batch-answer-bytes, a body nested near the JSON parser's depth limit; and a reservation
    booked with ``POST /reservations`` (201) is remembered like one a selection booked."""
    trio_replicas = [SelectReplica(tmp_path, name, *servers) for name in ("a", "b", "c")]
    for replica in trio_replicas:
        replica.argv += ["--max-batch-answer-bytes", "1024"]
    async with (
        running(trio_replicas) as (a, b, _),
        open_kv_publisher() as publisher,
        client(a) as through_a,
        client(b) as to_b,
    ):
        model = model_owned_by(b.url, [r.url for r in trio_replicas])
        await wait_for_members(through_a, 3)
        assert (await through_a.post("/workers", json=worker_record(1, model, publisher))).status_code == 201
        query = {"model_name": model, "token_ids": TOKENS}
        assert len((await to_b.post("/select", json=query)).content) > 200  # 30 answers pass 1024 bytes together
        statuses: list[int] = []

        async def select() -> None:
            statuses.append((await through_a.post("/select", json=query)).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(30):
                nursery.start_soon(select)
        assert statuses == [200] * 30

        body = orjson.dumps(query)[:-1] + b',"deep":' + b"[" * 1022 + b"0" + b"]" * 1022 + b"}"
        headers = {"content-type": "application/json"}
        direct = await to_b.post("/select", content=body, headers=headers)
        forwarded = await through_a.post("/select", content=body, headers=headers)
        assert (forwarded.status_code, direct.status_code) == (200, 200), forwarded.text

        assert (await through_a.post("/select", json={**query, "selection_id": "s1"})).status_code == 200
        reserved = await through_a.post("/reservations", json={"model_name": model, "selection_id": "s1"})
        assert reserved.status_code == 201, reserved.text
        assert (await figures(through_a))["kvrouter_cluster_booked_reservations"] == 1
        before = (await figures(through_a))["kvrouter_cluster_forwarded_total"]
        assert (await through_a.delete("/reservations/s1")).status_code == 200
        assert (await figures(through_a))["kvrouter_cluster_forwarded_total"] - before == 1  # to B alone
