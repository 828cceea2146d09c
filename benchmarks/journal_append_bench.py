"""Micro-benchmark of the journal's hot path: encoding one record and appending it.

Every accepted request costs one ``encode_record`` and one ``Journal.append`` on the event loop, so
these two numbers bound the per-request journal overhead. It also times a full round (append, then
the writer writes it and calls the durable callback) under Durability.OFF, which has no fsync and
so shows the loop's own bookkeeping rather than the disk.

    .venv/bin/python -m benchmarks.journal_append_bench [--records 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import trio

from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.persistence.codec import decode_record, encode_record
from kvrouter.journal.file import FileJournal
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.store import Durability

SCOPE = ScopeKey("bench-model", "default")
EVENT = RequestAdded("request-0000001", 3, 0, tuple(range(10**12, 10**12 + 64)), 1024, 1_700_000_000_000_000_000)


def per_call_ns(run: Callable[[], float], repeat: int) -> tuple[float, float]:
    """Median and best of ``repeat`` runs, each returning nanoseconds per call."""
    samples = [run() for _ in range(repeat)]
    return statistics.median(samples), min(samples)


def time_encode(records: int) -> float:
    events = (EVENT,)
    started = time.perf_counter_ns()
    for _ in range(records):
        encode_record(SCOPE, events)
    return (time.perf_counter_ns() - started) / records


def time_decode(records: int) -> float:
    payload = encode_record(SCOPE, (EVENT,))
    started = time.perf_counter_ns()
    for _ in range(records):
        decode_record(payload)
    return (time.perf_counter_ns() - started) / records


def time_file_append(records: int) -> float:
    """Append alone: the writer is not started, so this is the loop's share of each request."""
    payload = encode_record(SCOPE, (EVENT,))

    async def main() -> float:
        with tempfile.TemporaryDirectory() as directory:
            journal = FileJournal.open(directory, Durability.OFF, max_backlog_bytes=1 << 40)
            append = journal.append
            started = time.perf_counter_ns()
            for _ in range(records):
                append(payload)
            return (time.perf_counter_ns() - started) / records

    return trio.run(main)


def time_memory_append(records: int) -> float:
    payload = encode_record(SCOPE, (EVENT,))
    journal = MemoryJournal()
    append = journal.append
    started = time.perf_counter_ns()
    for _ in range(records):
        append(payload)
    return (time.perf_counter_ns() - started) / records


def time_file_round(records: int) -> float:
    """Append + durable callback with the writer running (OFF: write(2), no fsync), 64 per turn."""
    payload = encode_record(SCOPE, (EVENT,))

    async def main() -> float:
        with tempfile.TemporaryDirectory() as directory:
            journal = FileJournal.open(directory, Durability.OFF)
            acknowledged = 0

            def acknowledge() -> None:
                nonlocal acknowledged
                acknowledged += 1

            async with trio.open_nursery() as nursery:
                await nursery.start(journal.run)
                started = time.perf_counter_ns()
                for _ in range(records // 64):
                    for _ in range(64):
                        journal.call_when_durable(journal.append(payload), acknowledge)
                    await journal.wait_for_room()
                    await trio.lowlevel.checkpoint()
                await journal.wait_durable(journal.last_lsn)
                elapsed = time.perf_counter_ns() - started
                await journal.aclose()
            assert acknowledged == records // 64 * 64
            return elapsed / acknowledged

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    payload = encode_record(SCOPE, (EVENT,))
    print(f"record: one RequestAdded with 64 hashes, {len(payload)} bytes; {args.records} records x {args.repeat} runs")
    for name, run in [
        ("encode_record", time_encode),
        ("decode_record", time_decode),
        ("FileJournal.append", time_file_append),
        ("MemoryJournal.append", time_memory_append),
        ("FileJournal append+ack (OFF)", time_file_round),
    ]:
        median, best = per_call_ns(lambda run=run: run(args.records), args.repeat)
        print(f"{name:30s} median {median / 1000:7.3f} us   best {best / 1000:7.3f} us")


if __name__ == "__main__":
    main()
