"""Answers that amplify: big batch answers, a command stream that never reads, many /ws/decisions subscribers.

    python benchmarks/answer_budget_attack.py [--python PY] [--only batch,stream,decisions] [--subscribers 250]
        [--seconds 10] [--stream-seconds 35] [--rounds 1]

Each attack runs against a fresh service (a subprocess, journal in a temporary directory; ``--durability always``
but for ``decisions``):

* ``batch``: a slot tracker with one worker of 4,096 dp ranks; one ``POST /batch`` of 1,000 ``GET /loads`` of its
  model (a ~52 KB request), then three such at once. A prober sends ``GET /health`` every 20 ms meanwhile.
* ``stream``: the same slot tracker; one ``/ws/commands`` client sends messages of 1,000 such reads (unordered) for
  ``--stream-seconds`` and never reads its socket, in the JSON format and then in the compact one.
* ``decisions``: a selection service with 16 workers (``--decisions-durability``, default off: what subscribers
  cost is CPU, and fsyncs on a shared disk would hide it); 4 clients loop select_and_reserve -> prefill_complete ->
  release for ``--seconds`` without subscribers, then with one ``/ws/decisions`` subscriber, then with
  ``--subscribers`` (a child process of raw sockets that read and discard every byte); ``--rounds`` times, the
  three alternating on the same service, then the medians (a busy machine moves them alike).

Printed per row: the service's RSS before / peak / after (after: 2 s after the attack ended), ``/health`` p50 /
p99 / max during it, and what the attack got (answers, bytes, lifecycles/s). ``--python`` runs the services with
another interpreter (a baseline checkout's venv) for before/after figures.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import msgpack
import orjson
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import BytesMessage, Request, TextMessage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, rss_bytes
from http_client import Connection

HOST = "127.0.0.1"
MIB = 1024 * 1024
RANKS = 4096
READS = 1000
WORKERS = 16
PROMPT_TOKENS = 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Service:
    """A kvrouter service subprocess and a thread sampling its RSS (peak since ``mark``)."""

    def __init__(self, python: str, service: str, extra: list[str]) -> None:
        self.port = free_port()
        self.data = Path(tempfile.mkdtemp(prefix="kvrouter-attack-"))
        argv = [python, "-m", "kvrouter.api.cli.main", service, "--port", str(self.port), "--data-dir", str(self.data)]
        argv += ["--fresh", "--log-level", "error", *extra]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        self.peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited with {self.process.returncode}")
            try:
                status, _ = trio.run(call, self.port, "GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the service did not start")

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.process.pid))
            except OSError:
                return
            time.sleep(0.005)

    def rss(self) -> int:
        return rss_bytes(self.process.pid)

    def cpu(self) -> float:
        """User + system CPU seconds of the service so far."""
        return cpu_seconds(self.process.pid)

    def mark(self) -> int:
        """The RSS now, and the peak restarted from it."""
        now = self.rss()
        self.peak = now
        return now

    def stop(self) -> None:
        self._stop.set()
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.data, ignore_errors=True)


async def call(port: int, method: str, path: str, body: object | None = None) -> tuple[int, bytes]:
    connection = await Connection.open(HOST, port)
    try:
        return await connection.send(connection.encode(method, path, body))
    finally:
        await connection.aclose()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples) or [0.0]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def probe_health(port: int, samples: list[float], stop: trio.Event) -> None:
    """``GET /health`` every 20 ms on its own connection until ``stop``."""
    connection = await Connection.open(HOST, port)
    raw = connection.encode("GET", "/health")
    try:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                await connection.send(raw)
            except (ConnectionError, trio.BrokenResourceError):  # closed by the server: the wait still counts
                await connection.aclose()
                connection = await Connection.open(HOST, port)
                await connection.send(raw)
            samples.append(time.perf_counter() - started)
            await trio.sleep(0.02)
    finally:
        await connection.aclose()


def health_text(samples: list[float]) -> str:
    return (
        f"/health p50 {percentile(samples, 0.5) * 1e3:.0f} ms, p99 {percentile(samples, 0.99) * 1e3:.0f} ms, "
        f"max {max(samples or [0.0]) * 1e3:.0f} ms"
    )


def rss_text(before: int, peak: int, after: int) -> str:
    return f"RSS {before / MIB:.0f} -> peak {peak / MIB:.0f} -> after {after / MIB:.0f} MiB"


# -- POST /batch ---------------------------------------------------------------------------------------------


def read_commands() -> list[dict[str, object]]:
    return [{"method": "GET", "path": "/loads?model_name=big"} for _ in range(READS)]


async def big_worker(port: int) -> None:
    body = {"worker_id": 1, "model_name": "big", "block_size": 16, "dp_start": 0, "dp_size": RANKS}
    status, answer = await call(port, "POST", "/register", body)
    if status >= 300:
        raise RuntimeError(f"register: {status} {answer[:200]!r}")


async def batch_attack(port: int, at_once: int) -> tuple[list[str], list[float]]:
    """``at_once`` batches of 1,000 reads; returns their outcomes and the /health samples meanwhile."""
    body = read_commands()
    outcomes: list[str] = []
    samples: list[float] = []
    stop = trio.Event()

    async def one() -> None:
        started = time.perf_counter()
        try:
            status, answer = await call(port, "POST", "/batch", body)
        except ConnectionError:
            outcomes.append(f"none: the service closed the connection after {time.perf_counter() - started:.1f} s")
            return
        results = orjson.loads(answer) if status == 200 else []
        statuses: dict[int, int] = {}
        for result in results:
            statuses[result["status"]] = statuses.get(result["status"], 0) + 1
        outcomes.append(f"{status}, {len(answer) / 1e6:.1f} MB, results {statuses}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_health, port, samples, stop)
        await trio.sleep(0.2)
        async with trio.open_nursery() as attackers:
            for _ in range(at_once):
                attackers.start_soon(one)
        stop.set()
    return outcomes, samples


def run_batch(python: str) -> None:
    service = Service(python, "slot-tracker", [])
    try:
        trio.run(big_worker, service.port)
        print(f"batch: {len(orjson.dumps(read_commands())) / 1e3:.0f} KB request of {READS} GET /loads of a "
              f"{RANKS}-rank worker", flush=True)  # fmt: skip
        for at_once in (1, 3):
            time.sleep(1.0)
            before = service.mark()
            outcomes, samples = trio.run(batch_attack, service.port, at_once)
            time.sleep(2.0)
            print(f"  {at_once} at once: {rss_text(before, service.peak, service.rss())}; {health_text(samples)}")
            for outcome in outcomes:
                print(f"    answer {outcome}", flush=True)
    finally:
        service.stop()


# -- the command stream, never read ---------------------------------------------------------------------------


async def open_raw_websocket(port: int, path: str, subprotocols: list[str]) -> tuple[trio.SocketStream, WSConnection]:
    """A WebSocket whose socket this code reads only for the handshake (the answer to the upgrade)."""
    stream = await trio.open_tcp_stream(HOST, port)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host=f"{HOST}:{port}", target=path, subprotocols=subprotocols)))
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        head += chunk
    if not head.startswith(b"HTTP/1.1 101"):
        raise ConnectionError(f"upgrade refused: {head[:200]!r}")
    ws.receive_data(head)
    list(ws.events())
    return stream, ws


async def never_reading(port: int, compact: bool, seconds: float) -> tuple[int, list[float]]:
    """Send messages of 1,000 reads for ``seconds`` without reading; returns how many were taken, and /health."""
    subprotocols = ["kvrouter.commands.msgpack.v1"] if compact else []
    stream, ws = await open_raw_websocket(port, "/ws/commands", subprotocols)
    sent = 0
    samples: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_health, port, samples, stop)
        with trio.move_on_after(seconds):
            while True:
                ids = range(sent * READS, (sent + 1) * READS)
                if compact:
                    payload = msgpack.packb([False, [[i, 0, "GET", "/loads?model_name=big"] for i in ids]])
                    frame = ws.send(BytesMessage(data=payload))
                else:
                    commands = [{"id": i, "method": "GET", "path": "/loads?model_name=big"} for i in ids]
                    frame = ws.send(TextMessage(data=orjson.dumps({"commands": commands, "ordered": False}).decode()))
                try:
                    await stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                sent += 1
        stop.set()
    await stream.aclose()
    return sent, samples


def run_stream(python: str, seconds: float) -> None:
    service = Service(python, "slot-tracker", [])
    try:
        trio.run(big_worker, service.port)
        for compact in (False, True):
            time.sleep(1.0)
            before = service.mark()
            sent, samples = trio.run(never_reading, service.port, compact, seconds)
            time.sleep(2.0)
            label = "compact" if compact else "JSON"
            print(
                f"stream ({label}, never read, {seconds:.0f} s): {sent} messages of {READS} reads taken; "
                f"{rss_text(before, service.peak, service.rss())}; {health_text(samples)}",
                flush=True,
            )
    finally:
        service.stop()


# -- /ws/decisions subscribers during a selection lifecycle load -----------------------------------------------


async def subscribers(port: int, count: int) -> None:
    """The child: ``count`` raw subscribers reading and discarding; prints "ready", then bytes read at EOF of stdin."""
    received = 0
    ready = 0
    all_ready = trio.Event()

    async def subscriber() -> None:
        nonlocal received, ready
        stream, _ = await open_raw_websocket(port, "/ws/decisions", [])
        ready += 1
        if ready == count:
            all_ready.set()
        while chunk := await stream.receive_some(1 << 20):
            received += len(chunk)

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(subscriber)
        await all_ready.wait()
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        print(received, flush=True)
        nursery.cancel_scope.cancel()


async def lifecycles(port: int, seconds: float, seed: int) -> tuple[float, list[float]]:
    """4 clients looping select_and_reserve -> prefill_complete -> release; lifecycles/s and /health samples."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1 << 20) for _ in range(PROMPT_TOKENS)] for _ in range(32)]
    done = 0
    samples: list[float] = []
    stop = trio.Event()

    async def client(index: int) -> None:
        nonlocal done
        connection = await Connection.open(HOST, port)
        n = 0
        try:
            while not stop.is_set():
                booking = f"attack-{seed}-{index}-{n}"
                body = {"model_name": "bench", "token_ids": prompts[n % 32], "reservation_id": booking}
                for raw in (
                    connection.encode("POST", "/select_and_reserve", body),
                    connection.encode("POST", f"/reservations/{booking}/prefill_complete"),
                    connection.encode("DELETE", f"/reservations/{booking}"),
                ):
                    status, answer = await connection.send(raw)
                    if status >= 300:
                        raise RuntimeError(f"lifecycle: {status} {answer[:200]!r}")
                done += 1
                n += 1
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_health, port, samples, stop)
        for index in range(4):
            nursery.start_soon(client, index)
        started = time.perf_counter()
        await trio.sleep(seconds)
        stop.set()
    return done / (time.perf_counter() - started), samples


async def selection_workers(port: int) -> None:
    for worker in range(WORKERS):
        body = {"worker_id": worker, "model_name": "bench", "endpoint": f"http://127.0.0.1:{9000 + worker}/v1",
                "block_size": 16}  # fmt: skip
        status, answer = await call(port, "POST", "/workers", body)
        if status >= 300:
            raise RuntimeError(f"POST /workers: {status} {answer[:200]!r}")


def measure(service: Service, seconds: float, count: int, seed: int) -> tuple[float, float, str]:
    """Lifecycles/s and service CPU ms per lifecycle while ``count`` subscribers (a child process, none for 0) read
    /ws/decisions; and the row's text."""
    child = None
    if count:
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", str(service.port), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the subscribers did not start")
    before, cpu = service.mark(), service.cpu()
    child_cpu = cpu_seconds(child.pid) if child is not None else 0.0
    rate, samples = trio.run(lifecycles, service.port, seconds, seed)
    cpu = (service.cpu() - cpu) / (rate * seconds) * 1e3
    if child is not None:
        child_cpu = (cpu_seconds(child.pid) - child_cpu) / seconds
    text = (
        f"decisions: {count} subscribers: {rate:.0f} lifecycles/s, service CPU {cpu:.2f} ms per lifecycle; "
        f"{health_text(samples)}; {rss_text(before, service.peak, service.rss())}"
    )
    if child is not None:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        received = int(child.stdout.readline())
        child.wait(timeout=10)
        text += f"; the subscribers read {received / 1e6:.0f} MB, their process used {child_cpu:.0%} of a core"
    return rate, cpu, text


def run_decisions(python: str, seconds: float, count: int, durability: str, rounds: int, skip_one: bool) -> None:
    """``rounds`` rounds of: lifecycles without subscribers, with one (what explaining each selection costs), with
    ``count`` (not one with ``skip_one``); then the medians, and the median of the rounds' ratios (with ``count``
    over without: rates, and CPU per lifecycle)."""
    extra = ["--no-use-kv-events", "--durability", durability]  # bookings are the cache: no KV publishers
    service = Service(python, "select-service", extra)
    counts = sorted({0, count} if skip_one else {0, 1, count})
    figures: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    try:
        trio.run(selection_workers, service.port)
        trio.run(lifecycles, service.port, 1.0, 0)  # warm-up
        seed = 1
        for _ in range(rounds):
            for n in counts:
                rate, cpu, text = measure(service, seconds, n, seed)
                figures[n].append((rate, cpu))
                print(text, flush=True)
                seed += 1
    finally:
        service.stop()
    if rounds > 1:
        for n in counts:
            rates, cpus = [r for r, _ in figures[n]], [c for _, c in figures[n]]
            print(f"decisions: {n} subscribers, median of {rounds}: {median(rates):.0f} lifecycles/s "
                  f"({min(rates):.0f}..{max(rates):.0f}), service CPU {median(cpus):.2f} ms per lifecycle "
                  f"({min(cpus):.2f}..{max(cpus):.2f})", flush=True)  # fmt: skip
        for n in counts[1:]:
            for what, at in (("rate", 0), ("CPU per lifecycle", 1)):
                ratios = [with_n[at] / without[at] for with_n, without in zip(figures[n], figures[0], strict=True)]
                print(f"decisions: {n} subscribers / 0, {what}, per round: {' '.join(f'{r:.2f}' for r in ratios)}; "
                      f"median {median(ratios):.2f}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the services")
    parser.add_argument("--only", default="batch,stream,decisions", help="attacks to run, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="per lifecycle measurement")
    parser.add_argument("--stream-seconds", type=float, default=35.0, help="how long the stream client sends")
    parser.add_argument("--subscribers", type=int, default=250)
    parser.add_argument(
        "--decisions-durability", default="off", help="the selection service's --durability (the cost measured is CPU)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="decisions: rounds of 0 / 1 / N subscribers")
    parser.add_argument("--skip-one", action="store_true", help="decisions: rounds of 0 / N subscribers only")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trio.run(subscribers, int(args.child[0]), int(args.child[1]))
        return
    print(f"services: {args.python}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    only = set(args.only.split(","))
    if "batch" in only:
        run_batch(args.python)
    if "stream" in only:
        run_stream(args.python, args.stream_seconds)
    if "decisions" in only:
        run_decisions(
            args.python, args.seconds, args.subscribers, args.decisions_durability, args.rounds, args.skip_one
        )


if __name__ == "__main__":
    main()
