"""``kvrouter demo``: KV-aware routing paying off, on this machine, in well under a minute.

It starts a frontend and ``--workers`` mock workers on 127.0.0.1 (in this process, ports chosen by the kernel),
replays a built-in multi-turn chat workload (``simulations/generators.py``'s ``chat``: each turn resends the
conversation so far plus a new message) through a frontend with ``--router-mode kv`` and, at the same time, an
identical cluster behind a ``round-robin`` frontend, and prints side by side: prefix reuse (the workers'
``cached_tokens`` over prompt tokens), TTFT p50/p90 as the client measured it, and throughput. ``--plots DIR``
also writes ``DIR/demo.png``. Everything it started stops with it.

Sessions are replayed closed-loop: a session's next turn is sent a think time after its previous answer ended,
as a user would, so the conversation it extends has been served (and cached) by then.
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import math
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio

from kvrouter.actors.core.router_config import RouterConfig, parse_router_mode
from kvrouter.api.frontend.options import FrontendLimits, FrontendOptions
from kvrouter.api.frontend.service import FrontendHandle, run_frontend
from kvrouter.api.mock_worker.service import MockWorkerOptions, run_mock_worker
from kvrouter.api.process import log_setup
from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION, STOPPED
from kvrouter.simulations.generators import DEFAULTS, chat
from kvrouter.simulations.timing import ENGINE_PRESETS

log = logging.getLogger("kvrouter.demo")

MODES = ("kv", "round-robin")
BLOCK_SIZE = 16  # the engine's KV block, tokens
TRACE_BLOCK = 128  # tokens per block of the workload's conversations
TURNS = 4
SPEEDUP = 1.0  # the engine model in real time: prefill time is then well above the proxy's own overhead
SESSIONS_PER_SECOND = 8.0
THINK_SECONDS = 0.1
OUTPUT_TOKENS = 8  # mean answer length (few: each token is one event through three HTTP hops)
CLIENT_TIMEOUT = 60.0
CLUSTER_START_SECONDS = 60.0


@attrs.frozen
class Turn:
    prompt: list[int]
    max_tokens: int


@attrs.frozen
class Session:
    start: float  # seconds after the replay starts
    turns: tuple[Turn, ...]
    gaps: tuple[float, ...]  # think time before each turn after the first


@attrs.define
class Outcome:
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    worker: str


@attrs.frozen
class ModeResult:
    mode: str
    outcomes: tuple[Outcome, ...]
    failures: int
    seconds: float

    @property
    def reuse(self) -> float:
        prompt = sum(o.prompt_tokens for o in self.outcomes)
        return sum(o.cached_tokens for o in self.outcomes) / prompt if prompt else 0.0

    def ttft_ms(self, quantile: float) -> float:
        return percentile([o.ttft for o in self.outcomes], quantile) * 1000

    @property
    def requests_per_second(self) -> float:
        return len(self.outcomes) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(o.output_tokens for o in self.outcomes) / self.seconds if self.seconds > 0 else 0.0

    def per_worker(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            counts[outcome.worker] = counts.get(outcome.worker, 0) + 1
        return dict(sorted(counts.items()))


def percentile(values: Sequence[float], quantile: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))]


def workload(requests: int, seed: int) -> list[Session]:
    """``requests`` turns in sessions of ``TURNS``, from the simulator's chat generator (same seed, same run)."""
    sessions = max(1, math.ceil(requests / TURNS))
    params = {
        **DEFAULTS["chat"],
        "sessions": sessions,
        "turns": TURNS,
        "rate": SESSIONS_PER_SECOND,
        "think_s": THINK_SECONDS,
        "output": OUTPUT_TOKENS,
    }
    rows = chat(random.Random(f"{seed}:demo"), params, TRACE_BLOCK)
    built = []
    for index in range(sessions):
        part = rows[index * TURNS : (index + 1) * TURNS][: max(0, requests - index * TURNS)]
        if not part:
            break
        turns = tuple(Turn(_tokens(hash_ids, length), output) for _, length, output, hash_ids in part)
        gaps = tuple((later[0] - earlier[0]) / 1000 for earlier, later in itertools.pairwise(part))
        built.append(Session(part[0][0] / 1000, turns, gaps))
    return built


def _tokens(hash_ids: Sequence[int], length: int) -> list[int]:
    """A conversation's token ids: each of its blocks a distinct run (shared blocks give shared ids)."""
    tokens: list[int] = []
    for hash_id in hash_ids:
        tokens.extend((hash_id * TRACE_BLOCK + offset) % (1 << 31) for offset in range(TRACE_BLOCK))
    return tokens[:length]


async def ask(http: httpx.AsyncClient, turn: Turn) -> Outcome:
    """One streamed completion through the frontend, timed at the client. Only the last event (the usage) is
    parsed: the first token is the first chunk carrying a ``"text"``, the rest is counted, not decoded."""
    body = {"prompt": turn.prompt, "max_tokens": turn.max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first = None
    tail = b""
    async with http.stream("POST", "/v1/completions", content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            text = (await response.aread())[:200]
            raise RuntimeError(f"{response.status_code} {text!r}")
        worker = response.headers.get("x-kvrouter-worker-id", "?")
        async for chunk in response.aiter_raw():
            if first is None and b'"text"' in chunk:
                first = time.perf_counter()
            tail = (tail + chunk)[-4096:]
    ended = time.perf_counter()
    usage: dict[str, Any] = {}
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage"' in event:
            usage = orjson.loads(event[6:]).get("usage") or {}
            break
    return Outcome(
        ttft=(first or ended) - started,
        latency=ended - started,
        prompt_tokens=int(usage.get("prompt_tokens", len(turn.prompt))),
        cached_tokens=int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", 0)),
        worker=worker,
    )


async def replay(url: str, sessions: list[Session]) -> tuple[list[Outcome], int, float]:
    outcomes: list[Outcome] = []
    failures = 0
    limits = httpx.Limits(max_connections=len(sessions) + 4, max_keepalive_connections=len(sessions) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT, limits=limits, trust_env=False) as http:
        headers = {"content-type": "application/json"}
        http.headers.update(headers)
        began = trio.current_time()

        async def run_session(session: Session) -> None:
            nonlocal failures
            await trio.sleep_until(began + session.start)
            for index, turn in enumerate(session.turns):
                if index:
                    await trio.sleep(session.gaps[index - 1])
                try:
                    outcomes.append(await ask(http, turn))
                except (httpx.HTTPError, RuntimeError) as exc:
                    failures += 1
                    log.warning("a demo request failed: %s", exc)

        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(run_session, session)
        return outcomes, failures, trio.current_time() - began


async def run_mode(mode: str, workers: int, sessions: list[Session], speedup: float, seed: int) -> ModeResult:
    """A fresh cluster (frontend in ``mode``, ``workers`` workers with empty caches) in a process of its own, the
    workload from this one, then the cluster stopped."""
    command = [sys.executable, "-m", "kvrouter.api.cli.demo", "--serve-cluster", mode, "--workers", str(workers)]
    command += ["--speedup", str(speedup), "--seed", str(seed)]
    process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        url = await _cluster_url(process)
        outcomes, failures, seconds = await replay(url, sessions)
    finally:
        with trio.CancelScope(shield=True):
            await _stop(process)
    return ModeResult(mode, tuple(outcomes), failures, seconds)


async def _cluster_url(process: trio.Process) -> str:
    """The frontend's URL, which the cluster process prints once every worker's KV events are subscribed."""
    assert process.stdout is not None
    received = b""
    with trio.fail_after(CLUSTER_START_SECONDS):
        while b"\n" not in received:
            chunk = await process.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"the demo's cluster process exited with status {await process.wait()}")
            received += chunk
    return received.split(b"\n", 1)[0].decode().strip()


async def _stop(process: trio.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


async def serve_cluster(mode: str, workers: int, speedup: float, seed: int) -> None:
    """``--serve-cluster MODE``: a frontend and ``workers`` mock workers in this process; prints the frontend's
    URL when they are ready, then serves until SIGTERM or SIGINT."""
    canonical = parse_router_mode(mode)
    assert canonical is not None
    options = FrontendOptions(
        port=0,
        router=RouterConfig(router_mode=canonical),
        block_size=BLOCK_SIZE,
        seed=seed,
        limits=FrontendLimits(request_timeout=CLIENT_TIMEOUT),
    )
    preset = ENGINE_PRESETS["dynamo-mocker"]
    engine = attrs.evolve(preset, block_size=BLOCK_SIZE, num_blocks=preset.num_blocks * preset.block_size // BLOCK_SIZE)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            frontend: FrontendHandle = await nursery.start(run_frontend, options)
            for index in range(workers):
                worker = MockWorkerOptions(
                    engine=engine, speedup=speedup, register_url=frontend.url, worker_id=index + 1, register_attempts=3
                )
                await nursery.start(run_mock_worker, worker)
            await _listening(frontend, workers)
            sys.stdout.write(frontend.url + "\n")
            sys.stdout.flush()
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


async def _listening(frontend: FrontendHandle, count: int) -> None:
    """Until every worker's KV-event listener is subscribed (events published before would be missed)."""
    with trio.fail_after(CLUSTER_START_SECONDS):
        while True:
            rows = await frontend.routing.service.workers()
            ready = [r for r in rows if r.listeners and all(s.get("state") == "active" for s in r.listeners.values())]
            if len(ready) >= count:
                return
            await trio.sleep(0.02)


async def run_demo(workers: int, requests: int, speedup: float, seed: int) -> list[ModeResult]:
    """Both modes at once, each with its own frontend and workers, the same sessions at the same moments: they
    share whatever else the machine is doing, so the comparison stays fair on a busy machine."""
    sessions = workload(requests, seed)
    log.info("replaying %d requests in %d sessions with --router-mode %s", requests, len(sessions), " and ".join(MODES))
    results: dict[str, ModeResult] = {}

    async def one(mode: str) -> None:
        results[mode] = await run_mode(mode, workers, sessions, speedup, seed)

    async with trio.open_nursery() as nursery:
        for mode in MODES:
            nursery.start_soon(one, mode)
    return [results[mode] for mode in MODES]


def report(results: list[ModeResult], workers: int, requests: int, width: int | None = None) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvrouter demo: {requests} chat requests, {workers} mock workers, through the frontend")
    table.add_column("")
    for result in results:
        table.add_column(f"--router-mode {result.mode}", justify="right")
    rows = [
        ("prefix reuse (cached / prompt tokens)", lambda r: f"{r.reuse:.1%}"),
        ("TTFT p50", lambda r: f"{r.ttft_ms(0.5):.1f} ms"),
        ("TTFT p90", lambda r: f"{r.ttft_ms(0.9):.1f} ms"),
        ("throughput", lambda r: f"{r.requests_per_second:.1f} req/s, {r.tokens_per_second:.0f} tok/s"),
        ("requests per worker", lambda r: " ".join(str(n) for n in r.per_worker().values())),
        ("failed requests", lambda r: str(r.failures)),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(result) for result in results))
    console = Console(file=io.StringIO(), width=width or 100, record=True, force_terminal=False, color_system=None)
    console.print(table)
    return console.export_text()


def plot(results: list[ModeResult], directory: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    names = [result.mode for result in results]
    colours = ["tab:green", "tab:gray"][: len(results)]
    axes[0].bar(names, [result.reuse * 100 for result in results], color=colours)
    axes[0].set_title("prefix reuse (%)")
    for result, colour in zip(results, colours, strict=True):
        ttfts = sorted(o.ttft * 1000 for o in result.outcomes)
        axes[1].plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=result.mode, color=colour)
    axes[1].set_title("TTFT CDF")
    axes[1].set_xlabel("ms")
    axes[1].legend()
    axes[2].bar(names, [result.tokens_per_second for result in results], color=colours)
    axes[2].set_title("output tokens/s")
    figure.tight_layout()
    path = directory / "demo.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(BAD_CONFIGURATION, f"{self.prog}: {message} (see --help)\n")


def _count(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be between {low} and {high}")
        return value

    return parse


def _speedup(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0.1 and 1000")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvrouter demo", description=__doc__.split("\n\n")[1] if __doc__ else None)
    parser.add_argument("--workers", type=_count(1, 16), default=4, help="mock workers (default 4)")
    parser.add_argument("--requests", type=_count(1, 4000), default=400, help="requests per mode (default 400)")
    parser.add_argument("--plots", metavar="DIR", help="also write DIR/demo.png")
    parser.add_argument(
        "--speedup", type=_speedup, default=SPEEDUP, help=f"engine model speed-up (default {SPEEDUP:g})"
    )
    parser.add_argument("--seed", type=_count(0, 2**32), default=1, help="workload seed (default 1)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--serve-cluster", choices=MODES, help=argparse.SUPPRESS)  # the demo's own child process
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_setup.configure(args.log_level, "demo")
    if args.serve_cluster is not None:
        trio.run(serve_cluster, args.serve_cluster, args.workers, args.speedup, args.seed)
        return 0
    started = time.perf_counter()
    try:
        results = trio.run(run_demo, args.workers, args.requests, args.speedup, args.seed)
    except KeyboardInterrupt:
        log.error("interrupted")
        return STOPPED
    except BaseException as exc:
        log.error("the demo stopped: %s", exc, exc_info=exc)
        return STOPPED
    sys.stdout.write(report(results, args.workers, args.requests))
    if args.plots:
        sys.stdout.write(f"plot: {plot(results, Path(args.plots))}\n")
    sys.stdout.write(f"done in {time.perf_counter() - started:.1f} s\n")
    return 1 if any(result.failures for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
