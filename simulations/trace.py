"""Request traces: what the simulated clients send, and when.

A trace is a list of requests with an arrival time, an output length and a prompt described by
``hash_ids``: ids of the trace's prompt blocks (``block_size`` tokens each, 512 in Mooncake traces).
Equal ids mean equal block content and a request's ids form its prefix chain, so the prompt's token
ids are synthesised from them: every token of trace block ``i`` is ``hash_ids[i]`` (mod 2**32), and
the prompt is cut at ``input_length``. That is how the reference's mocker builds them too, and it maps
a trace's block size onto any engine block size deterministically: engine block ``j`` holds tokens
``[j*B, (j+1)*B)`` of that sequence, and two requests share an engine block exactly when they share
the trace blocks under it.

Mooncake JSONL: one object per line with ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids``; an ``input_length`` larger than ``len(hash_ids) * block_size`` is cut to that
(the reference does the same), an ``output_length`` of 0 is read as 1 (a request yields at least one
token). A line that is not such an object stops loading with its line number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import repeat
from pathlib import Path

import attrs
import orjson

MOONCAKE_BLOCK_SIZE = 512
TOKEN_MASK = 0xFFFFFFFF


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@attrs.frozen
class TraceRequest:
    index: int  # position in the trace: names the request (``req-<index>``) and orders equal arrivals
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def token_ids(self, trace_block_size: int) -> list[int]:
        """The prompt's synthesised token ids (see the module doc)."""
        tokens: list[int] = []
        for hash_id in self.hash_ids:
            tokens.extend(repeat(hash_id & TOKEN_MASK, trace_block_size))
            if len(tokens) >= self.input_length:
                break
        del tokens[self.input_length :]
        return tokens


@attrs.frozen
class Trace:
    requests: tuple[TraceRequest, ...]
    block_size: int = MOONCAKE_BLOCK_SIZE
    source: str = ""

    def sped_up(self, speedup: float) -> Trace:
        """Arrival times divided by ``speedup`` (``--speedup``)."""
        if not (speedup > 0 and math.isfinite(speedup)):
            raise TraceError(f"--speedup must be a positive number, got {speedup}")
        if speedup == 1:
            return self
        requests = tuple(attrs.evolve(r, arrival_ms=r.arrival_ms / speedup) for r in self.requests)
        return attrs.evolve(self, requests=requests)

    def head(self, count: int | None) -> Trace:
        """The first ``count`` requests in arrival order (``--requests``), or all."""
        if count is None or count >= len(self.requests):
            return self
        return attrs.evolve(self, requests=self.requests[:count])

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def from_rows(rows: Iterable[tuple[float, int, int, Sequence[int]]], block_size: int, source: str) -> Trace:
    """A trace from (arrival_ms, input_length, output_length, hash_ids) rows, sorted by arrival (stable)."""
    requests = [
        TraceRequest(0, float(at), min(int(isl), len(ids) * block_size), max(1, int(osl)), tuple(ids))
        for at, isl, osl, ids in rows
    ]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    ordered = tuple(attrs.evolve(requests[i], index=n) for n, i in enumerate(order))
    return Trace(ordered, block_size, source)


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Read a Mooncake JSONL trace; raises ``TraceError`` naming the first bad line."""
    if block_size <= 0:
        raise TraceError(f"trace block size must be positive, got {block_size}")
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rows.append(_mooncake_row(line, f"{path}:{number}"))
    if not rows:
        raise TraceError(f"trace {path} holds no requests")
    return from_rows(rows, block_size, str(path))


def _mooncake_row(line: bytes, where: str) -> tuple[float, int, int, list[int]]:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected an object with timestamp, input_length, output_length, hash_ids")
    missing = [k for k in ("input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    at = row.get("timestamp", 0)
    isl, osl, ids = row["input_length"], row["output_length"], row["hash_ids"]
    if not _number(at) or at < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {at!r}")
    for name, value in (("input_length", isl), ("output_length", osl)):
        if not _int(value) or value < 0:
            raise TraceError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    if not isinstance(ids, list) or not ids or not all(_int(h) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of non-negative integers")
    if isl == 0:
        raise TraceError(f"{where}: input_length must be at least 1")
    return float(at), isl, osl, ids


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return (_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]
