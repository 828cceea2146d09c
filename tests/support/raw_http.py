"""HTTP/1.1 over a raw trio socket: for what a client library hides (early answers, slow or odd clients)."""

from __future__ import annotations

from urllib.parse import urlsplit

import attrs
import orjson
import trio


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[bytes, bytes]  # lower-cased names; the last value wins
    body: bytes

    def json(self) -> object:
        return orjson.loads(self.body)

    @property
    def closes(self) -> bool:
        return self.headers.get(b"connection", b"").lower() == b"close"


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address(url))


class ResponseReader:
    """Reads responses (content-length framed) off one connection, keeping what follows each."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _more(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise EOFError(f"connection closed; unparsed: {self.buffer[:200]!r}")
        self.buffer += chunk

    async def response(self) -> RawResponse:
        while b"\r\n\r\n" not in self.buffer:
            await self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            await self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return RawResponse(int(status_line.split()[1]), headers, body)

    async def closed(self) -> bool:
        """Whether the server closes the connection (EOF or reset) with nothing more to read."""
        try:
            chunk = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return True
        return chunk == b"" and not self.buffer


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: kvrouter"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body and "content-length" not in (headers or {}):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(url: str, data: bytes) -> RawResponse:
    """Send ``data`` on a new connection and read one response."""
    stream = await connect(url)
    async with stream:
        await stream.send_all(data)
        return await ResponseReader(stream).response()
