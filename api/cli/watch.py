"""``kvrouter watch URL``: follow a service's live streams from a terminal.

    kvrouter watch http://127.0.0.1:8091                  a live table of loads per worker (GET /ws/loads)
    kvrouter watch http://127.0.0.1:8092 --decisions      a scrolling log of selections (GET /ws/decisions)
    kvrouter watch URL --json                             one JSON line per message, for scripts
    kvrouter watch URL --model-name llama --tenant-id t1  only these scopes
    kvrouter watch URL --cluster                          a cluster replica's members and scope owners, each move
                                                          a line (GET /cluster, polled: ``watch_cluster``)

A service with a token (``--auth-token-file``) needs ``--token-file FILE`` (or ``$KVROUTER_AUTH_TOKEN_FILE``).
A bad URL is one line and exit 2; a refused connection, a refused upgrade or a stream the service closes is
one line and exit 1; Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlencode, urlsplit

import orjson
import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table
from trio_websocket import ConnectionClosed, ConnectionRejected, WebSocketConnection

from kvrouter.api.cli.one_line_parser import OneLineParser
from kvrouter.api.cli.watch_cluster import ClusterWatchFailed, follow_cluster
from kvrouter.api.http.auth import TOKEN_FILE_ENV, BearerToken, TokenFileError
from kvrouter.client.live import open_stream, stream_url

PING_SECONDS = 10.0  # the service closes a connection silent for its body timeout (30 s by default)
SCOPE_FIELDS = ("model_name", "tenant_id", "routing_group")
HEADERS = {  # short column titles, so a table fits 80 columns
    "worker_id": "worker",
    "dp_rank": "rank",
    "active_prefill_tokens": "prefill tokens",
    "active_decode_blocks": "decode blocks",
    "potential_prefill_tokens": "prefill tokens",
    "potential_decode_blocks": "decode blocks",
    "active_requests": "requests",
}
BAD_CONFIGURATION = 2
FAILED = 1


class WatchError(Exception):
    """One line for the user; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = FAILED) -> None:
        super().__init__(message)
        self.status = status


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvrouter watch",
        description="Follow a kvrouter service's loads (or, with --decisions, its selections) live.",
    )
    parser.add_argument("url", help="the service's URL, e.g. http://127.0.0.1:8091")
    parser.add_argument("--decisions", action="store_true", help="selections and why (selection service only)")
    parser.add_argument(
        "--cluster", action="store_true", help="a cluster replica's scope owners: a line per move (GET /cluster)"
    )
    parser.add_argument("--json", action="store_true", help="print each message as one JSON line")
    parser.add_argument("--model-name", help="only this model's scopes")
    parser.add_argument("--tenant-id", help="only this tenant's scopes (routing_group)")
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"a file holding the service's bearer token (default ${TOKEN_FILE_ENV}, if set)",
    )
    return parser


def target(args: argparse.Namespace) -> str:
    """The ws:// URL to open, filters included; ValueError for a URL that cannot be one."""
    parts = urlsplit(args.url if "://" in args.url else "http://" + args.url)
    if parts.path not in ("", "/"):
        raise ValueError(f"{args.url!r}: give the service's base URL (no path), e.g. http://127.0.0.1:8091")
    query = dict(part.split("=", 1) if "=" in part else (part, "") for part in parts.query.split("&") if part)
    if args.model_name is not None:
        query["model_name"] = args.model_name
    if args.tenant_id is not None:
        query["tenant_id"] = args.tenant_id
    base = f"{parts.scheme}://{parts.netloc}" + (f"?{urlencode(query)}" if query else "")
    return stream_url(base, "/ws/decisions" if args.decisions else "/ws/loads")


def base_of(args: argparse.Namespace) -> str:
    """The service's base URL (``--cluster`` polls it); ValueError as ``target``."""
    target(args)
    parts = urlsplit(args.url if "://" in args.url else "http://" + args.url)
    if args.decisions:
        raise ValueError("--cluster and --decisions do not combine: --cluster follows a slot-tracker replica")
    return f"{parts.scheme}://{parts.netloc}"


async def follow_owners(base_url: str, token: str | None, args: argparse.Namespace, out: TextIO) -> None:
    try:
        await follow_cluster(base_url, token, args.json, out, args.model_name, args.tenant_id)
    except ClusterWatchFailed as exc:
        raise WatchError(str(exc)) from None


def token_of(args: argparse.Namespace) -> str | None:
    raw, source = args.token_file, "--token-file"
    if raw is None and os.environ.get(TOKEN_FILE_ENV):
        raw, source = os.environ[TOKEN_FILE_ENV], TOKEN_FILE_ENV
    if raw is None:
        return None
    try:
        BearerToken.from_file(Path(raw), source)  # checks it as the service does
    except TokenFileError as exc:
        raise WatchError(str(exc), BAD_CONFIGURATION) from None
    return Path(raw).read_bytes().strip().decode("ascii")


# -- rendering --------------------------------------------------------------------------------------------


class LoadTable:
    """The latest loads of every scope seen; a scope's update replaces its rows."""

    def __init__(self) -> None:
        self.scopes: dict[tuple[str, str], dict[str, Any]] = {}
        self.missed = 0  # intermediate states the service conflated (gaps in seq)
        self.messages = 0

    def apply(self, message: dict[str, Any]) -> None:
        self.messages += 1
        if message["type"] == "snapshot":
            self.scopes = {(s["model_name"], s["tenant_id"]): s for s in message["scopes"]}
        elif message["type"] == "update":
            key = (message["model_name"], message["tenant_id"])
            known = self.scopes.get(key)
            if known is not None:
                self.missed += max(0, message["seq"] - known["seq"] - 1)
            if message["loads"]:
                self.scopes[key] = message
            else:
                self.scopes.pop(key, None)

    def render(self, url: str) -> Table:
        table = Table(title=f"loads at {url}", caption=self._caption(), expand=False)
        columns: list[str] = []
        for scope in self.scopes.values():
            for row in scope["loads"]:
                columns.extend(name for name in row if name not in SCOPE_FIELDS and name not in columns)
        for name in ("model", "tenant", *columns, "seq"):
            table.add_column(HEADERS.get(name, name), justify="right" if name not in ("model", "tenant") else "left")
        for (model, tenant), scope in sorted(self.scopes.items()):
            pending = f" (queued {scope['pending_count']})" if scope.get("pending_count") else ""
            for row in scope["loads"]:
                cells = [str(row.get(name, "")) for name in columns]
                table.add_row(model, tenant + pending, *cells, str(scope["seq"]))
        return table

    def _caption(self) -> str:
        shown = time.strftime("%H:%M:%S")
        return f"{len(self.scopes)} scopes, {self.messages} messages, {self.missed} states conflated - {shown}"


def decision_line(message: dict[str, Any]) -> str:
    explain = message["explain"]
    chosen = next(
        (
            c
            for c in explain["candidates"]
            if (c["worker_id"], c["dp_rank"]) == (message["worker_id"], message["dp_rank"])
        ),
        None,
    )
    reason = explain["reason"] + (f" ({explain['rule']})" if explain.get("rule") else "")
    cost = chosen["cost"] if chosen is not None else None
    cost_text = f"{cost:.2f}" if isinstance(cost, float) and math.isfinite(cost) else "-"
    cached = chosen["cached_tokens"] if chosen is not None else 0
    booked = "reserve" if message["reserved"] else "select "
    stamp = time.strftime("%H:%M:%S", time.localtime(message["at_ns"] / 1e9))
    return (
        f"{stamp} #{message['seq']} {booked} {message['model_name']}/{message['tenant_id']} -> worker "
        f"{message['worker_id']} rank {message['dp_rank']}: {reason}, cost {cost_text}, cached {cached} "
        f"of {explain['isl_tokens']} tokens, {len(explain['candidates'])} candidates"
    )


# -- following --------------------------------------------------------------------------------------------


async def keep_alive(ws: WebSocketConnection) -> None:
    while True:
        await trio.sleep(PING_SECONDS)
        await ws.ping()


async def follow(url: str, token: str | None, mode: str, out: TextIO) -> None:
    """Print or show messages until the service closes the stream (WatchError) or the user stops."""
    try:
        async with open_stream(url, token=token) as ws, trio.open_nursery() as nursery:
            nursery.start_soon(keep_alive, ws)
            try:
                if mode == "json":
                    await _print_json(ws, out)
                elif mode == "decisions":
                    await _print_decisions(ws, out)
                else:
                    await _show_loads(ws, url, out)
            except ConnectionClosed as closed:
                raise WatchError(_closed_line(closed)) from None
    except ConnectionRejected as refused:
        raise WatchError(_refused_line(url, refused)) from None
    except OSError as exc:
        raise WatchError(f"cannot connect to {url}: {exc.strerror or exc}; is the service running?") from None


async def _print_json(ws: WebSocketConnection, out: TextIO) -> None:
    while True:
        message = await ws.get_message()
        out.write(message if isinstance(message, str) else message.decode())
        out.write("\n")
        out.flush()


async def _print_decisions(ws: WebSocketConnection, out: TextIO) -> None:
    console = Console(file=out, highlight=False)
    last = None
    while True:
        message = orjson.loads(await ws.get_message())
        if message["type"] == "ready":
            console.print(f"following decisions after #{message['seq']} (Ctrl-C to stop)")
            last = message["seq"]
        elif message["type"] == "decision":
            if last is not None and message["seq"] > last + 1:
                console.print(f"[dim]... {message['seq'] - last - 1} decisions dropped (this terminal was slow)[/]")
            last = message["seq"]
            console.print(decision_line(message), soft_wrap=True)


async def _show_loads(ws: WebSocketConnection, url: str, out: TextIO) -> None:
    table = LoadTable()
    console = Console(file=out)
    with Live(table.render(url), console=console, auto_refresh=False) as live:
        while True:
            table.apply(orjson.loads(await ws.get_message()))
            live.update(table.render(url), refresh=True)


def _closed_line(closed: ConnectionClosed) -> str:
    reason = closed.reason
    if reason is None:
        return "the connection to the service broke"
    detail = f": {reason.reason}" if reason.reason else ""
    return f"the service closed the stream ({reason.code}{detail})"


def _refused_line(url: str, refused: ConnectionRejected) -> str:
    body = refused.body or b""
    try:
        message = orjson.loads(body).get("error", "")
    except (orjson.JSONDecodeError, AttributeError):
        message = body.decode(errors="replace")[:200]
    hint = " (pass --token-file)" if refused.status_code == 401 else ""
    hint = " (is this the selection service? --decisions needs it)" if refused.status_code == 404 else hint
    return f"{url} refused the stream: {refused.status_code} {message}{hint}"


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    try:
        url = base_of(args) if args.cluster else target(args)
        token = token_of(args)
    except ValueError as exc:
        print(f"kvrouter watch: {exc}", file=sys.stderr)
        return BAD_CONFIGURATION
    except WatchError as exc:
        print(f"kvrouter watch: {exc}", file=sys.stderr)
        return exc.status
    mode = "json" if args.json else "decisions" if args.decisions else "loads"
    try:
        if args.cluster:
            trio.run(follow_owners, url, token, args, out)
        else:
            trio.run(follow, url, token, mode, out)
    except BaseException as exc:  # anything but Ctrl-C or a WatchError is raised again
        leaves = list(_leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
            return 0
        failure = next((leaf for leaf in leaves if isinstance(leaf, WatchError)), None)
        if failure is None:
            raise
        print(f"kvrouter watch: {failure}", file=sys.stderr)
        return failure.status
    return 0


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside the nurseries' exception groups (a stream the service closes or a Ctrl-C arrives
    wrapped in one group per nursery it crossed)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
