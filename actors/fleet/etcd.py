"""A small etcd v3 client over its JSON gateway (``/v3/kv/range``, ``/v3/watch``, ``/v3/lease/*``, ``/v3/kv/txn``),
on httpx, so it runs on trio.

What discovery needs: list a prefix at one revision (paginated), watch a prefix from a revision (the gateway
streams one JSON object per line), and a cheap liveness probe; and what a cluster's membership needs
(``actors/cluster``): grant and renew a lease, put a key under it, create a key only if it is absent (the claim
transaction), delete a key. Keys and values travel base64-encoded; 64-bit
integers travel as JSON strings. Several endpoints may be given: a failed call moves on to the next one.

Bounds: one watch message is at most ``MAX_MESSAGE_BYTES`` (a message over it ends the watch with an error, and the
caller lists again); each list page holds at most ``PAGE_KEYS`` keys.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, cast

import attrs
import httpx
import orjson

PAGE_KEYS: Final = 1000
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
REQUEST_TIMEOUT_SECONDS: Final = 5.0


class EtcdUnavailable(Exception):
    """No endpoint answered (or the answer was not etcd's): the caller keeps what it had and retries."""


class Compacted(Exception):
    """The watch's start revision was compacted away: list again."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted (etcd keeps history from {revision})")
        self.revision = revision


@attrs.frozen
class Change:
    key: str
    value: bytes | None  # None: deleted (a lease expiry deletes too)
    revision: int


OnChanges = Callable[[list[Change], int], Awaitable[None]]


def prefix_end(prefix: bytes) -> bytes:
    """The key just past every key starting with ``prefix`` (etcd's range_end for a prefix; ``\\0``: to the end)."""
    raw = bytearray(prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _key(encoded: str) -> str:
    return base64.b64decode(encoded).decode("utf-8", errors="replace")


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


class EtcdClient:
    def __init__(self, endpoints: list[str], client: httpx.AsyncClient) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0
        self._client = client

    @property
    def endpoint(self) -> str:
        return self._endpoints[self._current]

    def _next_endpoint(self) -> None:
        self._current = (self._current + 1) % len(self._endpoints)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        problems = []
        for _ in self._endpoints:
            url = self.endpoint + path
            try:
                response = await self._client.post(url, content=orjson.dumps(body), timeout=REQUEST_TIMEOUT_SECONDS)
                if response.status_code == 200:
                    data = orjson.loads(response.content)
                    if isinstance(data, dict):
                        return data
                problems.append(f"{url}: HTTP {response.status_code}")
            except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                problems.append(f"{url}: {type(exc).__name__}: {exc}".rstrip(": "))
            self._next_endpoint()
        raise EtcdUnavailable("; ".join(problems))

    async def list_prefix(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        """Every key under ``prefix`` with its value, all at one revision; and that revision."""
        end = _b64(prefix_end(prefix.encode()))
        start = _b64(prefix.encode())
        revision = 0
        found: list[tuple[str, bytes]] = []
        while True:
            body: dict[str, Any] = {"key": start, "range_end": end, "limit": PAGE_KEYS}
            if revision:
                body["revision"] = str(revision)
            data = await self._post("/v3/kv/range", body)
            if not revision:
                revision = _int(data.get("header", {}).get("revision"))
            kvs = data.get("kvs") or []
            for kv in kvs:
                found.append((_key(kv["key"]), base64.b64decode(kv.get("value", ""))))
            if not data.get("more") or not kvs:
                return revision, found
            start = base64.b64encode(base64.b64decode(kvs[-1]["key"]) + b"\0").decode()

    async def revision(self) -> int:
        """The store's current revision (a liveness probe: one tiny request)."""
        data = await self._post("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})
        return _int(data.get("header", {}).get("revision"))

    async def grant(self, ttl_seconds: int) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (seconds)."""
        data = await self._post("/v3/lease/grant", {"TTL": str(ttl_seconds)})
        lease_id = _int(data.get("ID"))
        if not lease_id:
            raise EtcdUnavailable(f"etcd granted no lease: {data.get('error', data)}")
        return lease_id, _int(data.get("TTL"))

    async def keep_alive(self, lease_id: int) -> int:
        """Renew the lease once: its remaining TTL in seconds, 0 when it is gone (expired or revoked)."""
        data = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return _int(data.get("result", {}).get("TTL"))

    async def revoke(self, lease_id: int) -> None:
        """End the lease now (and delete every key under it)."""
        await self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    async def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        """Set ``key`` (under ``lease_id`` when given); the revision of the write."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        data = await self._post("/v3/kv/put", body)
        return _int(data.get("header", {}).get("revision"))

    async def create_if_absent(self, key: str, value: bytes, lease_id: int) -> tuple[bool, bytes | None, int]:
        """``If(CreateRevision(key) == 0) Then(Put(key, value, lease)) Else(Get(key))``: whether this call created
        the key; else the value it holds (None if it vanished meanwhile) and its lease."""
        encoded = _b64(key.encode())
        body = {
            "compare": [{"key": encoded, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": encoded, "value": _b64(value), "lease": str(lease_id)}}],
            "failure": [{"request_range": {"key": encoded}}],
        }
        data = await self._post("/v3/kv/txn", body)
        if data.get("succeeded"):
            return True, value, lease_id
        for response in data.get("responses") or []:
            for kv in response.get("response_range", {}).get("kvs") or []:
                return False, base64.b64decode(kv.get("value", "")), _int(kv.get("lease"))
        return False, None, 0

    async def delete_if_value(self, key: str, value: bytes) -> bool:
        """``If(Value(key) == value) Then(Delete(key))``: whether it deleted the key (False: absent, or another's)."""
        encoded = _b64(key.encode())
        body = {
            "compare": [{"key": encoded, "target": "VALUE", "result": "EQUAL", "value": _b64(value)}],
            "success": [{"request_delete_range": {"key": encoded}}],
        }
        data = await self._post("/v3/kv/txn", body)
        return bool(data.get("succeeded"))

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key.encode())})

    async def watch(self, prefix: str, start_revision: int, on_changes: OnChanges) -> None:
        """Stream the changes under ``prefix`` from ``start_revision`` on, calling ``on_changes(changes,
        revision)`` per message, until the stream fails: raises EtcdUnavailable, or Compacted."""
        body = {
            "create_request": {
                "key": _b64(prefix.encode()),
                "range_end": _b64(prefix_end(prefix.encode())),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoint + "/v3/watch"
        try:
            async with self._client.stream(
                "POST", url, content=orjson.dumps(body), timeout=httpx.Timeout(REQUEST_TIMEOUT_SECONDS, read=None)
            ) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"{url}: HTTP {response.status_code}")
                buffer = b""
                # Closed explicitly when the watch ends early (cancelled, or an error), not left to the collector.
                async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], response.aiter_bytes())) as chunks:
                    async for chunk in chunks:
                        buffer += chunk
                        while b"\n" in buffer:
                            line, buffer = buffer.split(b"\n", 1)
                            if line.strip():
                                await self._message(line, on_changes)
                        if len(buffer) > MAX_MESSAGE_BYTES:
                            raise EtcdUnavailable(f"{url}: a watch message over {MAX_MESSAGE_BYTES} bytes")
                if buffer.strip():
                    await self._message(buffer, on_changes)
        except httpx.HTTPError as exc:
            self._next_endpoint()
            raise EtcdUnavailable(f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")) from None
        self._next_endpoint()
        raise EtcdUnavailable(f"{url}: the watch stream ended")

    async def _message(self, line: bytes, on_changes: OnChanges) -> None:
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise EtcdUnavailable(f"a watch message is not JSON ({exc})") from None
        if "error" in message:
            raise EtcdUnavailable(f"watch error: {message['error']}")
        result = message.get("result", {})
        compact = _int(result.get("compact_revision"))
        if compact:
            raise Compacted(compact)
        if result.get("canceled"):
            raise EtcdUnavailable(f"the watch was canceled: {result.get('cancel_reason', 'no reason given')}")
        revision = _int(result.get("header", {}).get("revision"))
        changes = []
        for event in result.get("events") or []:
            kv = event.get("kv", {})
            deleted = event.get("type") == "DELETE"
            value = None if deleted else base64.b64decode(kv.get("value", ""))
            changes.append(Change(_key(kv["key"]), value, _int(kv.get("mod_revision"))))
        if changes or revision:
            await on_changes(changes, revision)
