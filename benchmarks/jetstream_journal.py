"""The file journal against the JetStream journal, R=1 (one nats-server) and R=3 (a cluster of three), all under
``always``, same run.

N producers each loop: append one request's record (``encode_record`` of a ``RequestAdded``, ~0.6 KB), wait until
the journal acknowledges it (file: its group's fsync; JetStream: the server's acknowledgement of its group's
message), repeat. Prints appends/s, records per write (group commit), and the p50/p99 of append -> acknowledged,
for each N in ``--producers``. It starts its own nats-servers (JetStream, temporary stores, free ports on
127.0.0.1): one alone, and three routed to each other (``-cluster``/``-routes``, each its own store) for the R=3
stream; and stops them by their PIDs.

    .venv/bin/python benchmarks/jetstream_journal.py [--producers 1,16,64] [--seconds 3] [--nats-server PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.journal.file import FileJournal
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.store import Durability, Journal
from kvrouter.simulations.process_faults.servers import binary, nats_cluster

SCOPE = ScopeKey("bench-model", "default")
EVENT = RequestAdded("request-0000001", 3, 0, tuple(range(10**12, 10**12 + 64)), 1024, 1_700_000_000_000_000_000)


async def drive(journal: Journal, producers: int, seconds: float) -> tuple[int, list[float]]:
    """Appends acknowledged within ``seconds`` and each one's latency (seconds)."""
    payload = encode_record(SCOPE, (EVENT,))
    latencies: list[float] = []
    deadline = trio.current_time() + seconds

    async def producer() -> None:
        while trio.current_time() < deadline:
            await journal.wait_for_room()
            started = time.perf_counter()
            lsn = journal.append(payload)
            await journal.wait_durable(lsn)
            latencies.append(time.perf_counter() - started)

    async with trio.open_nursery() as nursery:
        for _ in range(producers):
            nursery.start_soon(producer)
    return len(latencies), latencies


async def measure(name: str, open_journal: Callable[[], Journal], producers: int, seconds: float) -> None:
    journal = await trio.to_thread.run_sync(open_journal)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        count, latencies = await drive(journal, producers, seconds)
        stats = journal.statistics()  # type: ignore[attr-defined]
        await journal.aclose()
    writes = getattr(stats, "batches_written", None) or getattr(stats, "messages_published", 0)
    quantiles = statistics.quantiles(latencies, n=100)
    print(
        f"{name:<14} producers {producers:>3}: {count / seconds:>8.0f} appends/s, "
        f"{count / max(writes, 1):>5.1f} records/write, "
        f"ack p50 {quantiles[49] * 1e3:.2f} ms, p99 {quantiles[98] * 1e3:.2f} ms"
    )


async def run(args: argparse.Namespace) -> None:
    producers = [int(n) for n in args.producers.split(",")]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        one = tuple(node.url for node in stack.enter_context(nats_cluster(args.nats_server, tmp / "one", 1)))
        three = tuple(node.url for node in stack.enter_context(nats_cluster(args.nats_server, tmp / "three", 3)))
        for n in producers:
            path = tmp / f"file-{n}"
            await measure("file (always)", lambda p=path: FileJournal.open(p, Durability.ALWAYS), n, args.seconds)
            for name, servers, replicas in (("jetstream R=1", one, 1), ("jetstream R=3", three, 3)):
                opened = partial(JetStreamJournal.open, servers, f"BENCH{n}", Durability.ALWAYS, replicas=replicas)
                await measure(name, opened, n, args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producers", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--nats-server", default=binary("nats-server", "/usr/sbin/nats-server"))
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
