"""Micro-benchmark of the journal's hot path: encoding one record and appending it.

Every accepted request costs one ``encode_record`` and one ``Journal.append`` on the event loop, so
these two numbers bound the per-request journal overhead. It also times a full round (append, then
the writer writes it and calls the durable callback) under Durability.OFF, which has no fsync and
so shows the loop's own bookkeeping rather than the disk.

Group commit under ALWAYS: N producers each loop "handle a request" (``--work-us`` of CPU split
into 1 to 4 steps with a scheduling turn between each, as a request passes from the connection's task
to the app to an actor; so a burst's appends come a few turns apart), append, and wait until that
record is durable. It prints appends/s, records per fsync and the p50/p99 of
append -> durable for each N in ``--producers``.

    .venv/bin/python -m benchmarks.journal_append_bench [--records 200000] [--repeat 5]
        [--producers 1,4,16,32] [--seconds 2] [--work-us 100]
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


def spin(microseconds: float) -> None:
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def group_commit_round(producers: int, seconds: float, work_us: float) -> tuple[float, float, float, float]:
    """ALWAYS with ``producers`` request loops: (appends/s, records per fsync, p50 us, p99 us)."""
    payload = encode_record(SCOPE, (EVENT,))

    async def main() -> tuple[float, float, float, float]:
        latencies: list[float] = []
        with tempfile.TemporaryDirectory() as directory:
            journal = FileJournal.open(directory, Durability.ALWAYS)
            async with trio.open_nursery() as nursery:
                await nursery.start(journal.run)
                stop_at = time.perf_counter() + seconds

                async def producer(steps: int) -> None:
                    while time.perf_counter() < stop_at:
                        spin(work_us / steps)
                        for _ in range(steps - 1):
                            await trio.lowlevel.checkpoint()  # a hand-over to the next task
                            spin(work_us / steps)
                        durable = trio.Event()
                        started = time.perf_counter()
                        journal.call_when_durable(journal.append(payload), durable.set)
                        await durable.wait()
                        latencies.append(time.perf_counter() - started)

                first = journal.statistics()
                began = time.perf_counter()
                async with trio.open_nursery() as producers_nursery:
                    for index in range(producers):
                        producers_nursery.start_soon(producer, 1 + index % 4)
                elapsed = time.perf_counter() - began
                last = journal.statistics()
                await journal.aclose()
        records = last.last_lsn - first.last_lsn
        fsyncs = max(1, last.fsyncs - first.fsyncs)
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1e6
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6
        return records / elapsed, records / fsyncs, p50, p99

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--producers", default="1,4,16,32", help="group commit rounds (ALWAYS); empty: none")
    parser.add_argument("--seconds", type=float, default=2.0, help="per group commit round")
    parser.add_argument("--work-us", type=float, default=100.0, help="CPU per request around each append")
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
    for producers in [int(n) for n in args.producers.split(",") if n]:
        rate, per_fsync, p50, p99 = group_commit_round(producers, args.seconds, args.work_us)
        print(
            f"ALWAYS, {producers:2d} producers, {args.work_us:g} us work: {rate:8.0f} appends/s   "
            f"records/fsync {per_fsync:6.2f}   append->durable p50 {p50:6.0f} us  p99 {p99:6.0f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
