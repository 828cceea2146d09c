"""A damaged record at a restart: a worker's KV events are skipped and replayed, a client's write stops the start.

One flipped bit in a KV-index record used to leave the service refusing to start, with a cut after the lsn
before it as the only way out, and that cut took every later record: the clients' acknowledged reservations
with it. The KV record can be rebuilt (the worker replays it), so now it is skipped with one warning and its
stream replays from before it; a damaged record a client wrote still stops the start, naming the repair that
moves out only that record.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.events import KvIndexed
from kvrouter.actors.persistence.codec import decode_record
from kvrouter.journal.repair import RecordInfo, inspect_records
from kvrouter.journal.store import CorruptJournal
from tests.api.test_select_recovery import BLOCK, TOKENS, store, wait_blocks
from tests.conftest import start_select_service
from tests.support.kv_publisher import open_kv_publisher

RESERVATIONS = [f"r{i}" for i in range(5)]


def flip_payload_bit(data_dir: Path, record: RecordInfo) -> None:
    segment = data_dir / record.segment
    data = bytearray(segment.read_bytes())
    data[record.offset + 16 + record.size // 2] ^= 0x04
    segment.write_bytes(bytes(data))


def records(data_dir: Path) -> list[RecordInfo]:
    return [entry for entry in inspect_records(data_dir, head_bytes=1 << 20) if isinstance(entry, RecordInfo)]


def kv_record_of_seq(data_dir: Path, seq: int) -> RecordInfo:
    for entry in records(data_dir):
        events = decode_record(entry.head).events
        if any(isinstance(event, KvIndexed) and event.seq == seq for event in events):
            return entry
    raise AssertionError(f"no KV record of seq {seq}")


async def active_requests(url: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        partitions = (await http.get("/loads")).json()
    return sum(row["active_requests"] for partition in partitions for row in partition["loads"])


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


async def write_history(data_dir: Path, publisher_endpoint: str, replay_endpoint: str | None, publish: object) -> None:
    """A worker with three KV batches (one record each, seqs 0..2), then the clients' reservations."""
    worker = {
        "worker_id": 5,
        "model_name": "m",
        "endpoint": "http://w5",
        "block_size": BLOCK,
        "kv_events_endpoint": publisher_endpoint,
        "replay_endpoint": replay_endpoint,
    }
    async with trio.open_nursery() as nursery:
        handle = await start_select_service(nursery, data_dir)
        url = handle.urls[0]
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.post("/workers", json=worker)).status_code == 201
            for seq in range(3):  # one at a time: each batch its own record
                publish(store([seq + 1], TOKENS[4 * seq : 4 * seq + 4], parent=seq or None))  # type: ignore[operator]
                await wait_blocks(url, seq + 1)
            for reservation in RESERVATIONS:
                body = {"model_name": "m", "token_ids": TOKENS[:12], "reservation_id": reservation}
                assert (await http.post("/select_and_reserve", json=body)).status_code == 200
        handle.stop()


async def test_a_damaged_kv_record_is_skipped_with_one_warning_and_the_worker_replays_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    async with open_kv_publisher() as publisher:
        await write_history(data, publisher.endpoint, publisher.replay_endpoint, publisher.publish)
        flip_payload_bit(data, kv_record_of_seq(data, 1))
        replays_before = len(publisher.replay_requests)

        caplog.set_level(logging.INFO, logger="kvrouter")
        async with trio.open_nursery() as nursery:
            handle = await start_select_service(nursery, data)  # before: CorruptJournal, the service did not start
            url = handle.urls[0]
            assert await active_requests(url) == len(RESERVATIONS)  # every acknowledged reservation is there
            # The stream resumed from before the skipped batch: the worker replays it and the index is whole again.
            await wait_blocks(url, 3)
            assert publisher.replay_requests[replays_before] == 1
            assert await metric(url, "kvrouter_journal_damaged_records_skipped") == 1
            handle.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvrouter.journal"]
    assert len(warnings) == 1, warnings
    assert "skipped 1 damaged record of workers' KV events" in warnings[0]
    assert "1 KV-event stream resumes from before it" in warnings[0]


async def test_a_damaged_client_write_stops_the_start_and_names_the_quarantine(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_kv_publisher() as publisher:
        await write_history(data, publisher.endpoint, publisher.replay_endpoint, publisher.publish)
    booking = next(entry for entry in records(data) if b"request_added" in entry.head)
    flip_payload_bit(data, booking)

    with pytest.RaisesGroup(CorruptJournal, flatten_subgroups=True) as refused:
        async with trio.open_nursery() as nursery:
            await start_select_service(nursery, data)
    message = str(refused.value.exceptions[0])
    assert f"`kvrouter journal quarantine --data-dir {data} --lsn {booking.lsn} --yes`" in message
    assert "could lose an acknowledged write" in message and "\n" not in message
