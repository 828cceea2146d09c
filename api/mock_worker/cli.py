"""``kvrouter mock-worker``: parse the flags, start the worker, stop on SIGINT/SIGTERM.

A bad flag or value is one line and exit 2; a port in use is one line and exit 2; a registration the
selection service refuses (4xx) is exit 2, one it never answered is exit 1.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import attrs
import trio
import zmq

from kvrouter import __version__
from kvrouter.api.cli.one_line_parser import OneLineParser
from kvrouter.api.http.auth import BearerToken, TokenFileError
from kvrouter.api.mock_worker.kv_publisher import DEFAULT_BUFFER_BATCHES, DEFAULT_BUFFER_BYTES
from kvrouter.api.mock_worker.openai_app import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_REQUESTS,
    AppLimits,
)
from kvrouter.api.mock_worker.registration import RegistrationFailed
from kvrouter.api.mock_worker.service import MockWorkerOptions, run_until_signal
from kvrouter.api.process import log_setup
from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION, INTERRUPTED, STOPPED
from kvrouter.api.process.exposure import INSECURE_NO_AUTH, add_insecure_flag, is_loopback
from kvrouter.simulations.timing import ENGINE_PRESETS

log = logging.getLogger("kvrouter.mock_worker")

DEFAULT_PORT = 8100
DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default KV-events port
DEFAULT_BLOCK_SIZE = 16  # vLLM's default


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvrouter mock-worker",
        description="An OpenAI-compatible inference worker without a GPU: the simulator's engine model on the "
        "real clock, KV events over ZMQ in vLLM's wire format.",
    )
    parser.add_argument("--version", action="version", version=f"kvrouter {__version__}")
    parser.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"HTTP port, 0 for any (default {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--kv-events-port",
        type=_port,
        default=DEFAULT_KV_EVENTS_PORT,
        help=f"ZMQ PUB port of the KV events, 0 for any (default {DEFAULT_KV_EVENTS_PORT})",
    )
    parser.add_argument("--replay-port", type=_port, help="ZMQ ROUTER port serving missed KV batches (default: off)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; another address needs --insecure-no-auth)",
    )
    add_insecure_flag(parser, "although the mock worker has no authentication (anyone reaching it can send it prompts)")
    parser.add_argument(
        "--advertise-host", help="the host the selection service reaches this worker at (default: --host)"
    )
    parser.add_argument("--engine", choices=sorted(ENGINE_PRESETS), default="dynamo-mocker", help="timing preset")
    parser.add_argument(
        "--block-size",
        type=_positive(int),
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--blocks",
        type=_positive(int),
        help="KV cache size in blocks (default: the preset's capacity in tokens / --block-size)",
    )
    parser.add_argument("--max-batched-tokens", type=_positive(int), help="chunked-prefill budget per pass (preset's)")
    parser.add_argument("--max-running", type=_positive(int), help="sequences in the running batch (preset's)")
    parser.add_argument("--speedup", type=_positive(float), default=1.0, help="run the timing model X times faster")
    parser.add_argument("--model-name", default="mock", help="the model served (default mock)")
    parser.add_argument(
        "--max-requests",
        type=_positive(int),
        default=DEFAULT_MAX_REQUESTS,
        help=f"requests running or queued, first come first served; beyond, 503 (default {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=DEFAULT_BODY_LIMIT,
        help=f"request body limit (default {DEFAULT_BODY_LIMIT})",
    )
    parser.add_argument(
        "--replay-buffer-batches",
        type=_positive(int),
        default=DEFAULT_BUFFER_BATCHES,
        help=f"KV batches kept for replay, oldest dropped first (default {DEFAULT_BUFFER_BATCHES})",
    )
    parser.add_argument(
        "--replay-buffer-bytes",
        type=_positive(int),
        default=DEFAULT_BUFFER_BYTES,
        help=f"and at most this many bytes of them (default {DEFAULT_BUFFER_BYTES})",
    )
    parser.add_argument("--register", metavar="URL", help="register with the selection service at URL (POST /workers)")
    parser.add_argument(
        "--register-token-file",
        metavar="FILE",
        help="the bearer token of a selection service or frontend started with --auth-token-file (the file's text)",
    )
    parser.add_argument(
        "--register-attempts", type=_positive(int), default=10, help="tries before giving up (default 10)"
    )
    parser.add_argument(
        "--worker-id", type=_worker_id, help="the catalog's worker id (default: a hash of the endpoint)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return value


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number") from None
        if not 0 < value < float("inf"):  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
        return value

    return parse


def _worker_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker id (0 to 2**64-1)") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker id (0 to 2**64-1)")
    return value


def options_from(args: argparse.Namespace) -> MockWorkerOptions:
    preset = ENGINE_PRESETS[args.engine]
    blocks = args.blocks or max(1, preset.num_blocks * preset.block_size // args.block_size)
    engine = attrs.evolve(
        preset,
        block_size=args.block_size,
        num_blocks=blocks,
        max_batched_tokens=args.max_batched_tokens or preset.max_batched_tokens,
        max_running=args.max_running or preset.max_running,
    )
    return MockWorkerOptions(
        host=args.host,
        port=args.port,
        kv_events_port=args.kv_events_port,
        replay_port=args.replay_port,
        engine=engine,
        speedup=args.speedup,
        model_name=args.model_name,
        limits=AppLimits(
            body_limit=args.max_body_bytes, body_timeout=DEFAULT_BODY_TIMEOUT, max_requests=args.max_requests
        ),
        replay_buffer_batches=args.replay_buffer_batches,
        replay_buffer_bytes=args.replay_buffer_bytes,
        register_url=args.register,
        register_attempts=args.register_attempts,
        worker_id=args.worker_id,
        advertise_host=args.advertise_host,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log_setup.configure(args.log_level, "mock-worker")
    if args.register and args.host in ("0.0.0.0", "::", "") and not args.advertise_host:
        log.error(
            "cannot start: --host %s is not an address the selection service can reach; add --advertise-host", args.host
        )
        return BAD_CONFIGURATION
    if not is_loopback(args.host):
        if not args.insecure_no_auth:
            log.error(
                "cannot start: --host %s is reachable from other machines and the mock worker has no "
                "authentication; bind 127.0.0.1, or pass %s",
                args.host,
                INSECURE_NO_AUTH,
            )
            return BAD_CONFIGURATION
        log.warning("%s: serving on --host %s without authentication", INSECURE_NO_AUTH, args.host)
    ports = [p for p in (args.port, args.kv_events_port, args.replay_port) if p]
    if len(ports) != len(set(ports)):
        log.error(
            "cannot start: --port, --kv-events-port and --replay-port must differ (got %s)", ", ".join(map(str, ports))
        )
        return BAD_CONFIGURATION
    token = None
    if args.register_token_file is not None:
        try:
            token = read_token(Path(args.register_token_file))
        except TokenFileError as exc:
            log.error("cannot start: %s", exc)
            return BAD_CONFIGURATION
    options = attrs.evolve(options_from(args), register_token=token)
    try:
        trio.run(partial(run_until_signal, options))
    except BaseException as exc:  # every failure becomes one line
        return _explain(exc, args)
    return 0


def read_token(path: Path) -> str:
    """The token in ``path``, checked by the rules the services apply to their own token file."""
    BearerToken.from_file(path, "--register-token-file")  # raises TokenFileError with one line
    return path.read_bytes().strip().decode("ascii")


def _explain(exc: BaseException, args: argparse.Namespace) -> int:
    leaves = list(_leaves(exc))
    for leaf in leaves:
        if isinstance(leaf, RegistrationFailed):
            log.error("cannot start: %s", leaf)
            return BAD_CONFIGURATION if leaf.refused else STOPPED
        if isinstance(leaf, zmq.ZMQError) and leaf.errno == zmq.EADDRINUSE:
            log.error(
                "cannot start: a KV-events port (--kv-events-port %s or --replay-port %s) is in use on %s; pick "
                "another (0 picks a free one)",
                args.kv_events_port,
                args.replay_port,
                args.host,
            )
            return BAD_CONFIGURATION
        if isinstance(leaf, OSError) and leaf.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            log.error(
                "cannot start: cannot listen on %s port %s: %s; pick another --port or --host",
                args.host,
                args.port,
                leaf.strerror,
            )
            return BAD_CONFIGURATION
        if isinstance(leaf, zmq.ZMQError):
            log.error("cannot start: cannot bind the KV-events sockets on %s: %s", args.host, leaf)
            return BAD_CONFIGURATION
        if isinstance(leaf, KeyboardInterrupt):
            log.error("interrupted (Ctrl-C) while starting")
            return INTERRUPTED
    log.error("stopped by an unexpected error (a bug: please report it)", exc_info=exc)
    return STOPPED


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


if __name__ == "__main__":
    sys.exit(main())
