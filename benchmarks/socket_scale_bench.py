"""Socket-scale benchmark: the selection service with 4,096 worker ranks, each with a live KV-event publisher.

    python benchmarks/socket_scale_bench.py [--ranks 4096] [--ranks-per-worker 8] [--publisher-processes 4]
        [--batches 8] [--rate 1000] [--seconds 5] [--no-beyond] [--keep DIR]

Every rank gets its own ZMQ publisher (an XPUB: a PUB on the wire that also reports subscriptions), so the
service runs one KV listener per rank, as in a real cluster. The publishers live in a few helper processes
(this script re-run with ``--publish``; 1,024 sockets each by default) so that neither their sockets nor
their descriptors count against the service, and the machine's 2 cores are not oversubscribed.

Phases, each printed as it ends:

1. registration: ``POST /workers`` of ``ranks / ranks-per-worker`` workers (one ``kv_events_endpoints``
   entry per dp rank), one at a time; then until every publisher has seen its listener subscribe.
2. steady state, idle: the service's RSS, open descriptors, threads, and CPU used while nothing happens
   (listeners idle on their sockets).
3. ingest, twice: every rank publishes ``--batches`` batches of one 16-block chain, then one marker chain
   that all ranks share; done when ``POST /overlap_scores`` with the marker's tokens finds it on every rank
   (each listener delivers in order, so a rank holding the marker holds everything before it). First
   paced (``--rate`` batches/s from all publishers together), then, after the latency measurements,
   all at once: a burst backs the listeners up behind the scope's mailbox, and the listener totals from
   ``GET /workers`` (batches, gaps, lost batches, disconnects, unrepaired outages, restarts) show what that
   costs. The publishers have no replay endpoint, so a lost connection cannot be caught up: the listener
   counts it as an unrepaired outage.
4. between the two rounds: ``/select`` (64-block prompts sharing a prefix with one rank's chain) and
   ``/health`` latency, one client, one request at a time; and one ``GET /workers`` (every rank's
   listener status).
5. beyond capacity (unless ``--no-beyond``): a second service whose open-files limit is pinned at 1,024
   (hard and soft, so it cannot raise it), which affords ``listener_capacity(1024)`` = 64 listeners
   (actors/transport/socket_budget.py); registrations fill it, then more workers ask for more ranks, up to
   twice what its descriptors could hold or until one gets no answer: what they get, and whether the
   service stays up and keeps answering.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import trio
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, repo_env, rss_bytes, select_service_argv
from http_client import Connection
from select_service_bench import Latencies, Service, call, wait_status

from kvrouter.actors.transport.socket_budget import FDS_PER_LISTENER, listener_capacity

HOST = "127.0.0.1"
MODEL = "scale"
BLOCK_SIZE = 16
CHAIN_BLOCKS = 16  # blocks per published batch
CHAIN_TOKENS = CHAIN_BLOCKS * BLOCK_SIZE
PROMPT_BLOCKS = 64
MARKER_BASE = 1 << 30  # marker tokens: above every chain's


def marker_tokens(round_: int) -> list[int]:
    """The chain every rank publishes last in ingest round ``round_`` (the same tokens on every rank)."""
    start = MARKER_BASE + round_ * CHAIN_TOKENS
    return list(range(start, start + CHAIN_TOKENS))


MAX_RANKS, MAX_BATCHES = 8192, 32  # and two ingest rounds


def chain_id(round_: int, rank: int, batch: int) -> int:
    """Distinct per (round, rank, batch); its tokens stay below MARKER_BASE (2 x 8192 x 32 x 256 < 2**30)."""
    return (round_ * MAX_RANKS + rank) * MAX_BATCHES + batch


def block_hash(round_: int, rank: int, batch: int) -> int:
    return ((round_ << 40) | (rank << 20) | (batch << 6)) + 1  # 64 hashes apart: a chain's 16 never collide


PUBLISHER_HWM = 100_000  # per socket: nothing is dropped at these volumes
PINNED_OPEN_FILES = 1_024  # the beyond-capacity service's RLIMIT_NOFILE (soft = hard)
ANSWER_SECONDS = 10.0  # beyond capacity, a request unanswered this long counts as "no answer"


# ------------------------------------------------------------------------------ the publisher side


def chain_tokens(chain: int) -> list[int]:
    return list(range(chain * CHAIN_TOKENS, (chain + 1) * CHAIN_TOKENS))


def batch_payload(tokens: list[int], first_hash: int) -> bytes:
    """One KV-event batch ``[ts, [BlockStored], dp_rank]`` storing ``tokens`` as a chain from the root."""
    hashes = list(range(first_hash, first_hash + len(tokens) // BLOCK_SIZE))
    event = ["BlockStored", hashes, None, tokens, BLOCK_SIZE, None, None]
    return msgpack.packb([time.time(), [event], None])


def serve_publishers(first_rank: int, count: int) -> None:
    """A publisher process: ``count`` XPUB sockets for ranks ``first_rank..``; commands on stdin, one JSON
    line per command on stdout."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, count + 64)
    sockets: list[zmq.Socket[bytes]] = []
    ports: list[int] = []
    for _ in range(count):
        sock = context.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, PUBLISHER_HWM)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        ports.append(sock.bind_to_random_port(f"tcp://{HOST}"))
        sockets.append(sock)
    reply({"ports": ports})
    next_seq = [0] * count
    for line in sys.stdin:
        command = line.split()
        if command[0] == "wait":
            reply(wait_subscribed(sockets, float(command[1])))
        elif command[0] == "publish":  # publish ROUND BATCHES RATE (messages/s from this process; 0 = at once)
            round_, batches, rate = int(command[1]), int(command[2]), float(command[3])
            # Built before the clock starts: the service's ingest is measured, not msgpack here.
            plan = [
                (
                    i,
                    batch_payload(
                        chain_tokens(chain_id(round_, first_rank + i, b)), block_hash(round_, first_rank + i, b)
                    ),
                )
                for b in range(batches)
                for i in range(count)
            ]
            plan += [
                (i, batch_payload(marker_tokens(round_), block_hash(round_, first_rank + i, batches)))
                for i in range(count)
            ]
            started = time.perf_counter()
            for n, (i, payload) in enumerate(plan):
                if rate > 0 and n % 16 == 0:
                    ahead = started + n / rate - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
                sockets[i].send_multipart([b"", next_seq[i].to_bytes(8, "big"), payload], copy=False)
                next_seq[i] += 1
            reply({"seconds": time.perf_counter() - started, "messages": len(plan)})
    for sock in sockets:
        sock.close(linger=0)
    context.term()


def wait_subscribed(sockets: list[zmq.Socket[bytes]], timeout: float) -> dict[str, Any]:
    """Until every socket has seen a subscription (or ``timeout``): seconds waited, sockets still waiting."""
    started = time.perf_counter()
    waiting = {sock: i for i, sock in enumerate(sockets)}
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    while waiting:
        left = timeout - (time.perf_counter() - started)
        if left <= 0:
            break
        for sock, _ in poller.poll(left * 1000):
            message = sock.recv()
            if message[:1] == b"\x01" and sock in waiting:
                del waiting[sock]
                poller.unregister(sock)
    return {"seconds": time.perf_counter() - started, "missing": len(waiting)}


def reply(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


class PublisherProcess:
    """The driver's handle on one ``--publish`` subprocess."""

    def __init__(self, first_rank: int, count: int) -> None:
        self.first_rank, self.count = first_rank, count
        argv = [sys.executable, str(Path(__file__).resolve()), "--publish", str(first_rank), str(count)]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ports: list[int] = self.read()["ports"]

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        self.process.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"publisher process for ranks {self.first_rank}.. exited ({self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Publishers:
    """``ranks`` publishers spread over ``processes`` processes; commands go to all at once."""

    def __init__(self, ranks: int, processes: int) -> None:
        share = -(-ranks // processes)
        self.processes = [PublisherProcess(first, min(share, ranks - first)) for first in range(0, ranks, share)]
        self.endpoints = [f"tcp://{HOST}:{port}" for p in self.processes for port in p.ports]

    def all(self, command: str) -> list[dict[str, Any]]:
        for process in self.processes:
            process.send(command)
        return [process.read() for process in self.processes]

    def close(self) -> None:
        for process in self.processes:
            process.close()


# ------------------------------------------------------------------------------ the service side


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open descriptors, threads, and CPU seconds used so far (user + system)."""
    with open(f"/proc/{pid}/status") as status:
        threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mib": rss_bytes(pid) / 2**20,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": threads,
        "cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks,
    }


def start_service(workdir: Path, label: str, limit_open_files: int | None = None) -> Service:
    port = free_port()
    argv = select_service_argv(port, workdir / f"data-{port}", log_level="info")
    env = repo_env()
    service = Service(label, argv, port, workdir, env, REPO)
    if limit_open_files is None:
        service.start()
    else:  # soft = hard: the service cannot raise it (socket_budget.raise_open_files_limit stops at hard)
        pin = limit_open_files

        def preexec() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (pin, pin))

        with open(service.log_path, "ab") as log:
            service.started_at = time.perf_counter()
            service.process = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO, preexec_fn=preexec
            )
    return service


def capacity_line(service: Service) -> str | None:
    """The service's own startup report of its listener capacity (socket_budget logs it at info)."""
    try:
        text = service.log_path.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"KV listener capacity .*", text)
    return found.group(0) if found else None


def worker_body(worker: int, endpoints: list[str], per_worker: int) -> dict[str, Any]:
    return {
        "worker_id": worker,
        "model_name": MODEL,
        "endpoint": f"http://10.0.{worker // 256}.{worker % 256}:8000/v1",
        "block_size": BLOCK_SIZE,
        "data_parallel_start_rank": 0,
        "data_parallel_size": per_worker,
        "kv_events_endpoints": {str(r): endpoints[worker * per_worker + r] for r in range(per_worker)},
    }


async def register(port: int, workers: range, endpoints: list[str], per_worker: int) -> list[float]:
    """Register ``workers`` one at a time on one keep-alive connection; each request's latency."""
    latencies = []
    connection = await Connection.open(HOST, port)
    try:
        for worker in workers:
            raw = connection.encode("POST", "/workers", worker_body(worker, endpoints, per_worker))
            t0 = time.perf_counter()
            status, body = await connection.send(raw)
            latencies.append(time.perf_counter() - t0)
            if status not in (200, 201):
                raise RuntimeError(f"POST /workers {worker} -> {status}: {body[:300]!r}")
    finally:
        await connection.aclose()
    return latencies


async def marker_ranks(port: int, round_: int) -> int:
    """How many ranks hold round ``round_``'s whole marker chain."""
    body = {"model_name": MODEL, "token_ids": marker_tokens(round_)}
    status, answer = await call(port, "POST", "/overlap_scores", body)
    if status != 200:
        raise RuntimeError(f"/overlap_scores -> {status}: {answer}")
    return sum(1 for row in answer["workers"] if row["device_blocks"] == CHAIN_BLOCKS)


async def wait_for_marker(
    service: Service, round_: int, ranks: int, limit: float
) -> tuple[float | None, int, list[str]]:
    """Poll (every 50 ms, or 10x the last poll's time) until every rank holds the marker: (seconds or None
    after ``limit``, ranks holding it, the failed polls)."""
    started = time.perf_counter()
    have = 0
    failures: list[str] = []
    while time.perf_counter() - started < limit:
        service.check_alive()
        t0 = time.perf_counter()
        try:
            have = await marker_ranks(service.port, round_)
        except (ConnectionError, OSError) as exc:  # counted and reported: the service is still up
            failures.append(f"{time.perf_counter() - started:.1f} s: {exc}")
        if have == ranks:
            return time.perf_counter() - started, have, failures
        await trio.sleep(max(0.05, 10 * (time.perf_counter() - t0)))
    return None, have, failures


# Listener status counters summed per ingest round. unrepaired_outages: connections lost with no replay
# endpoint to catch up from (none here), so batches may be gone without a gap to show it.
LISTENER_COUNTERS = ("batches", "gaps", "lost_batches", "disconnects", "unrepaired_outages", "restarts")


def listener_totals(rows: Any) -> dict[str, int]:
    """Sums over every rank's listener status (GET /workers), and the count per state."""
    totals: dict[str, int] = {}
    for row in rows if isinstance(rows, list) else []:
        for listener in row.get("kv_listeners", {}).values():
            for key in (*LISTENER_COUNTERS, "malformed"):
                totals[key] = totals.get(key, 0) + int(listener.get(key) or 0)
            state = "state_" + str(listener.get("state"))
            totals[state] = totals.get(state, 0) + 1
    return totals


def ingest_round(
    service: Service, publishers: Publishers, round_: int, ranks: int, batches: int, rate: float
) -> dict[str, Any]:
    """Every rank publishes ``batches`` batches then its marker, at ``rate`` batches/s in all (0: at once)."""
    messages = ranks * (batches + 1)
    before = listener_totals(trio.run(call, service.port, "GET", "/workers")[1])
    cpu_before = process_figures(service.pid)["cpu_seconds"]
    share = rate / len(publishers.processes)
    started = time.perf_counter()
    for process in publishers.processes:
        process.send(f"publish {round_} {batches} {share}")
    expected = messages / rate if rate else 0.0
    seconds, have, failures = trio.run(wait_for_marker, service, round_, ranks, expected + max(120.0, messages / 500))
    publish_seconds = max(process.read()["seconds"] for process in publishers.processes)
    elapsed = time.perf_counter() - started
    after = listener_totals(trio.run(call, service.port, "GET", "/workers")[1])
    figures = process_figures(service.pid)
    return {
        "messages": messages,
        "seconds": seconds,
        "have": have,
        "publish_seconds": publish_seconds,
        "cpu": (figures["cpu_seconds"] - cpu_before) / elapsed,
        "rss_mib": figures["rss_mib"],
        "delta": {k: after.get(k, 0) - before.get(k, 0) for k in LISTENER_COUNTERS},
        "states": {k[6:]: v for k, v in after.items() if k.startswith("state_")},
        "failed_polls": failures,
    }


def print_ingest(label: str, ranks: int, result: dict[str, Any]) -> None:
    messages, seconds = result["messages"], result["seconds"]
    blocks = messages * CHAIN_BLOCKS
    head = f"  ingest, {label}: {messages:,} batches ({blocks:,} blocks) from {ranks:,} publishers"
    if seconds is None:
        outcome = f"NOT COMPLETE: {result['have']:,} of {ranks:,} ranks got their last batch"
    else:
        outcome = (
            f"all in after {seconds:.2f} s = {messages / seconds:,.0f} batches/s, {blocks / seconds:,.0f} blocks/s"
        )
    print(
        f"{head}: {outcome} (publishers took {result['publish_seconds']:.2f} s; service CPU {result['cpu'] * 100:.0f}% "
        f"of a core; RSS {result['rss_mib']:.0f} MiB); listeners: {result['delta']}, states {result['states']}",
        flush=True,
    )
    failed = result["failed_polls"]
    if failed:
        print(f"    {len(failed)} completion polls failed; first: {failed[0]}; last: {failed[-1]}", flush=True)


async def sequential(port: int, requests: list[bytes], seconds: float) -> Latencies:
    result = Latencies()
    connection = await Connection.open(HOST, port)
    try:
        stop_at = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, body = await connection.send(requests[n % len(requests)])
            result.samples.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"unexpected {status}: {body[:300]!r}")
            n += 1
    finally:
        await connection.aclose()
    return result


async def call_within(seconds: float, port: int, method: str, path: str, body: object | None = None) -> Any:
    """``call``, or None when no answer comes within ``seconds`` (e.g. the service cannot accept connections)."""
    with trio.move_on_after(seconds):
        return await call(port, method, path, body)
    return None


async def timed_get(port: int, path: str) -> tuple[float, int, Any]:
    t0 = time.perf_counter()
    status, answer = await call(port, "GET", path)
    return time.perf_counter() - t0, status, answer


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------------------ the phases


def at_scale(args: argparse.Namespace, publishers: Publishers, workdir: Path) -> None:
    ranks, per_worker = args.ranks, args.ranks_per_worker
    workers = ranks // per_worker
    service = start_service(workdir, "kvrouter-scale")
    try:
        trio.run(wait_status, service, "/health", 60.0)
        empty = process_figures(service.pid)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(
            f"  socket_budget.listener_capacity at this open-files limit ({hard}) = {listener_capacity(hard):,} "
            f"ranks; service log: {capacity_line(service) or 'no capacity line (the budget is not wired in)'}",
            flush=True,
        )
        print(
            f"  empty service: RSS {empty['rss_mib']:.0f} MiB, {empty['fds']:.0f} fds, {empty['threads']:.0f} threads",
            flush=True,
        )

        started = time.perf_counter()
        latencies = trio.run(register, service.port, range(workers), publishers.endpoints, per_worker)
        registered = time.perf_counter() - started
        waits = publishers.all(f"wait {args.subscribe_timeout}")
        subscribed = time.perf_counter() - started
        missing = sum(w["missing"] for w in waits)
        first, last = latencies[: max(1, workers // 8)], latencies[-max(1, workers // 8) :]
        print(
            f"  registration: {workers:,} workers x {per_worker} ranks = {ranks:,} listeners in {registered:.2f} s "
            f"(POST /workers p50 {ms(percentile(latencies, 0.5))}, p99 {ms(percentile(latencies, 0.99))}, "
            f"max {ms(max(latencies))}; first eighth p50 {ms(percentile(first, 0.5))}, last eighth p50 "
            f"{ms(percentile(last, 0.5))}); every publisher subscribed {subscribed:.2f} s after the first POST"
            + (f"; {missing} publishers NEVER saw a subscription" if missing else ""),
            flush=True,
        )

        time.sleep(2.0)  # let connection set-up settle
        before = process_figures(service.pid)
        time.sleep(args.idle_seconds)
        idle = process_figures(service.pid)
        idle_cpu = (idle["cpu_seconds"] - before["cpu_seconds"]) / args.idle_seconds
        per_rank_kib = (idle["rss_mib"] - empty["rss_mib"]) * 1024 / ranks
        print(
            f"  steady state with {ranks:,} idle listeners: RSS {idle['rss_mib']:.0f} MiB "
            f"(+{idle['rss_mib'] - empty['rss_mib']:.0f} MiB = {per_rank_kib:.1f} KiB per rank), "
            f"{idle['fds']:.0f} fds ({(idle['fds'] - empty['fds']) / ranks:.2f} per rank), "
            f"{idle['threads']:.0f} threads, idle CPU {idle_cpu * 100:.0f}% of a core "
            f"(over {args.idle_seconds:g} s)",
            flush=True,
        )

        paced = ingest_round(service, publishers, 0, ranks, args.batches, args.rate)
        print_ingest(f"paced at {args.rate:,.0f} batches/s", ranks, paced)

        rng = random.Random(9)
        encoder = Connection(None, f"{HOST}:{service.port}")  # type: ignore[arg-type]  # encoding only
        selects = []
        for _ in range(64):
            rank = rng.randrange(ranks)
            shared = rng.randint(1, CHAIN_BLOCKS)
            tokens = chain_tokens(chain_id(0, rank, rng.randrange(args.batches)))[: shared * BLOCK_SIZE]
            fresh = (1 << 31) + rng.getrandbits(29)
            tokens += range(fresh, fresh + PROMPT_BLOCKS * BLOCK_SIZE - len(tokens))
            selects.append(encoder.encode("POST", "/select", {"model_name": MODEL, "token_ids": tokens}))
        trio.run(sequential, service.port, selects, 0.5)  # warm-up
        select = trio.run(sequential, service.port, selects, args.seconds)
        health = trio.run(sequential, service.port, [encoder.encode("GET", "/health")], args.seconds)
        print(
            f"  /select over {ranks:,} ranks, 1 client: p50 {select.percentile(0.5) / 1e3:,.2f} ms, "
            f"p99 {select.percentile(0.99) / 1e3:,.2f} ms ({len(select.samples):,} requests); /health p50 "
            f"{health.percentile(0.5) / 1e3:.2f} ms, p99 {health.percentile(0.99) / 1e3:.2f} ms",
            flush=True,
        )
        took, status, rows = trio.run(timed_get, service.port, "/workers")
        states: dict[str, int] = {}
        for row in rows if status == 200 else []:
            for listener in row.get("kv_listeners", {}).values():
                states[listener["state"]] = states.get(listener["state"], 0) + 1
        print(f"  GET /workers: {status} in {ms(took)}; listener states {states}", flush=True)
        burst = ingest_round(service, publishers, 1, ranks, args.batches, 0.0)
        print_ingest("all at once", ranks, burst)
        service.check_alive()
    except BaseException:
        alive = service.process is not None and service.process.poll() is None
        print(f"  FAILED; service {'up' if alive else 'exited ' + str(service.process and service.process.returncode)}")
        print("  service log tail:\n    " + service.log_tail(20).replace("\n", "\n    "), flush=True)
        raise
    finally:
        service.stop()


def beyond_capacity(args: argparse.Namespace, publishers: Publishers, workdir: Path) -> None:
    """Fill the pinned service's listener capacity, ask for more, then keep going until descriptors run out."""
    per_worker = args.ranks_per_worker
    service = start_service(workdir, "kvrouter-pinned", limit_open_files=PINNED_OPEN_FILES)
    try:
        trio.run(wait_status, service, "/health", 60.0)
        capacity = listener_capacity(PINNED_OPEN_FILES)
        line = capacity_line(service)
        print(
            f"  open-files limit pinned at {PINNED_OPEN_FILES}: socket_budget.listener_capacity = {capacity} ranks; "
            f"service log: {line or 'no capacity line (the budget is not wired into the service)'}",
            flush=True,
        )
        fill = capacity // per_worker
        trio.run(register, service.port, range(fill), publishers.endpoints, per_worker)
        print(f"  registered {fill} workers x {per_worker} ranks = {fill * per_worker} listeners", flush=True)
        # Beyond: up to twice what the descriptors could hold at FDS_PER_LISTENER each, or until refused.
        last = min(len(publishers.endpoints), 2 * PINNED_OPEN_FILES // FDS_PER_LISTENER) // per_worker
        statuses: dict[str, int] = {}
        shown = 0
        tried = fill
        for extra in range(fill, last):
            tried = extra + 1
            if service.process is None or service.process.poll() is not None:
                break
            body = worker_body(extra, publishers.endpoints, per_worker)
            try:
                answered = trio.run(call_within, ANSWER_SECONDS, service.port, "POST", "/workers", body)
            except OSError as exc:
                print(f"  worker {extra}: POST /workers failed: {exc}", flush=True)
                break
            if answered is None:
                print(f"  worker {extra}: POST /workers got no answer within {ANSWER_SECONDS:g} s", flush=True)
                statuses["no answer"] = statuses.get("no answer", 0) + 1
                break
            status, answer = answered
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if shown < 2 or (status >= 300 and shown < 3):  # the first two, and the first refusal
                shown += 1
                print(f"  worker {extra} ({per_worker} more ranks): POST /workers -> {status} {str(answer)[:240]}")
        print(
            f"  workers {fill}..{tried - 1} ({(tried - fill) * per_worker} ranks beyond capacity): statuses {statuses}",
            flush=True,
        )
        time.sleep(2.0)
        alive = service.process is not None and service.process.poll() is None
        if not alive:
            print(f"  afterwards: service DOWN (exit {service.process and service.process.returncode})")
            return
        figures = process_figures(service.pid)
        answered = trio.run(call_within, ANSWER_SECONDS, service.port, "GET", "/health")
        health = answered[0] if answered else f"no answer within {ANSWER_SECONDS:g} s"
        answered = trio.run(call_within, ANSWER_SECONDS, service.port, "GET", "/workers")
        status, rows = answered if answered else (None, [])
        states: dict[str, int] = {}
        errors: list[str] = []
        for row in rows if status == 200 else []:
            for listener in row.get("kv_listeners", {}).values():
                states[listener["state"]] = states.get(listener["state"], 0) + 1
                if listener.get("last_error") and not errors:
                    errors.append(listener["last_error"])
        print(
            f"  afterwards: service up, /health {health}, listener states {states}, {figures['fds']:.0f} fds of "
            f"{PINNED_OPEN_FILES}" + (f"; first listener error: {errors[0][:200]}" if errors else ""),
            flush=True,
        )
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--ranks-per-worker", type=int, default=8)
    parser.add_argument("--publisher-processes", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="16-block batches per rank and round (plus a marker)")
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="batches/s, all publishers together, in the paced ingest round"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per latency measurement")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU measurement window")
    parser.add_argument("--subscribe-timeout", type=float, default=120.0)
    parser.add_argument("--no-beyond", action="store_true", help="skip the beyond-capacity phase")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep the services' logs and journals there")
    parser.add_argument("--publish", nargs=2, type=int, metavar=("FIRST", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        serve_publishers(*args.publish)
        return
    if args.ranks % args.ranks_per_worker:
        parser.error("--ranks must be a multiple of --ranks-per-worker")
    if not (0 < args.ranks <= MAX_RANKS and 0 < args.batches < MAX_BATCHES and args.rate > 0):
        parser.error(f"--ranks must be 1-{MAX_RANKS}, --batches 1-{MAX_BATCHES - 1}, --rate positive")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(
        f"socket scale: {args.ranks:,} ranks ({args.ranks // args.ranks_per_worker:,} workers x "
        f"{args.ranks_per_worker}), {args.publisher_processes} publisher processes; {os.cpu_count()} CPUs; "
        f"open-files limit here {soft}/{hard}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="socket-scale-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        publishers = Publishers(args.ranks, args.publisher_processes)
        print(f"  {len(publishers.endpoints):,} publishers bound in {time.perf_counter() - started:.2f} s", flush=True)
        try:
            phases: list[tuple[str, Callable[[argparse.Namespace, Publishers, Path], None]]] = [("at scale", at_scale)]
            if not args.no_beyond:
                phases.append(("beyond capacity", beyond_capacity))
            for name, phase in phases:
                print(f"{name}:", flush=True)
                phase(args, publishers, workdir)
            print(f"load average at the end {os.getloadavg()[0]:.1f} (other work on this machine competes)")
        finally:
            publishers.close()
            for log in sorted(workdir.glob("kvrouter-*.log")):
                errors = [line for line in log.read_text(errors="replace").splitlines() if " ERROR " in line]
                if errors:
                    print(f"  {log.name}: {len(errors)} error lines, first: {errors[0][:300]}")


if __name__ == "__main__":
    main()
