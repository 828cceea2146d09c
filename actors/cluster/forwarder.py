"""Carry a command to its scope's owner over HTTP (the owner's own API), once, and bring its answer back.

The request goes as the client sent it (method, path, query, body) with ``FORWARDED_HEADER`` added, naming this
replica (its advertise URL), so the owner never forwards it again (``core/ownership/forwarding.py``); an owner
whose view does not hold this replica (a moment behind, or after this replica's lease lapsed) refuses it
(``FORWARD_REFUSED_HEADER``), which is raised as ``OwnerUnreachable``: not applied.

Bounded: a connection pool of ``MAX_CONNECTIONS`` (``MAX_KEEPALIVE`` kept open), a connect timeout well under a
lease's TTL (a dead owner is found out quickly), and an answer timeout just past the owner's own reply deadline (it
answers 504 itself before that; the caller, ``ClusterSlotService.relay``, gives up sooner when the owner leaves the
live members); an answer larger than ``MAX_ANSWER_BYTES`` is refused. An owner that cannot be reached raises
``OwnerUnreachable``: the command was not applied there (a connection refused or reset before the request was sent
whole), or its outcome is unknown (no answer in time), which the caller says.
"""

from __future__ import annotations

from typing import Final

import attrs
import httpx

from kvrouter.actors.cluster.marks import FORWARDED_ANSWER_BYTES
from kvrouter.actors.core.ownership.forwarding import FORWARD_REFUSED_HEADER, FORWARDED_HEADER

WRITTEN_HEADER: Final = "kvrouter-written"  # (``follower_reads``) carried back with the owner's answer
MAX_CONNECTIONS: Final = 64
MAX_KEEPALIVE: Final = 16
CONNECT_TIMEOUT_SECONDS: Final = 0.5
MAX_ANSWER_BYTES: Final = FORWARDED_ANSWER_BYTES


class OwnerUnreachable(Exception):
    def __init__(self, message: str, *, unknown: bool) -> None:
        super().__init__(message)
        self.unknown = unknown  # the request may have reached the owner (no answer in time)


@attrs.frozen
class Relayed:
    status: int
    body: bytes
    content_type: bytes | None
    written: str | None = None  # a write's ``kvrouter-written`` token (``follower_reads``)
    headers: tuple[tuple[bytes, bytes], ...] = ()  # others a route sends (retry-after): a batch's result names them


class Forwarder:
    def __init__(self, answer_timeout: float, sender: str, authorization: str | None = None) -> None:
        """``sender``: this replica's advertise URL, the ``FORWARDED_HEADER`` its receivers check;
        ``authorization``: the ``Authorization`` header the replicas require (their shared bearer token)."""
        self._sender = sender
        self._authorization = authorization
        self._client = httpx.AsyncClient(
            trust_env=False,  # the replicas' own URLs: never through a proxy from the environment
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE),
            timeout=httpx.Timeout(answer_timeout, connect=CONNECT_TIMEOUT_SECONDS),
        )
        self.forwarded = 0
        self.failed = 0

    async def relay(self, owner: str, method: str, path: str, query: bytes, body: bytes) -> Relayed:
        url = owner.rstrip("/") + path + (("?" + query.decode("latin-1")) if query else "")
        headers = {FORWARDED_HEADER: self._sender}
        if self._authorization is not None:
            headers["authorization"] = self._authorization
        if body:
            headers["content-type"] = "application/json"
        self.forwarded += 1
        try:
            async with self._client.stream(method, url, content=body, headers=headers) as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise OwnerUnreachable(f"{owner} answered more than {MAX_ANSWER_BYTES} bytes", unknown=True)
                    chunks.append(chunk)
                if FORWARD_REFUSED_HEADER in response.headers:
                    why = b"".join(chunks)[:300].decode("utf-8", "replace")
                    raise OwnerUnreachable(f"{owner} refused the forward from {self._sender} ({why})", unknown=False)
                content_type = response.headers.get("content-type")
                body, written = b"".join(chunks), response.headers.get(WRITTEN_HEADER)
                return Relayed(response.status_code, body, content_type.encode() if content_type else None, written)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.failed += 1
            raise OwnerUnreachable(f"cannot reach {owner} ({type(exc).__name__})", unknown=False) from None
        except httpx.HTTPError as exc:
            self.failed += 1
            raise OwnerUnreachable(f"{owner} did not answer ({type(exc).__name__})", unknown=True) from None

    async def aclose(self) -> None:
        await self._client.aclose()
