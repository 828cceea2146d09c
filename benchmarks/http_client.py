"""A minimal keep-alive HTTP/1.1 client over trio sockets, for load generation only.

General clients (httpx) spend more CPU per request than the server under test would; on a
2-core machine that would measure the client. This one pre-encodes requests and parses only the
status line and content-length.
"""

from __future__ import annotations

import orjson
import trio


class Connection:
    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self._stream = stream
        self._host = host.encode()
        self._buffer = bytearray()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        return cls(await trio.open_tcp_stream(host, port), f"{host}:{port}")

    async def aclose(self) -> None:
        await self._stream.aclose()

    def encode(self, method: str, path: str, body: object | None = None) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nhost: ".encode() + self._host
        if body is None:
            return head + b"\r\n\r\n"
        payload = orjson.dumps(body)
        return (
            head
            + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        await self._stream.send_all(raw)
        return await self._read_response()

    async def _read_response(self) -> tuple[int, bytes]:
        buffer = self._buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buffer += chunk
        head = bytes(buffer[:end]).decode("latin-1")
        status = int(head[9:12])
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        total = end + 4 + length
        while len(buffer) < total:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buffer += chunk
        body = bytes(buffer[end + 4 : total])
        del buffer[:total]
        return status, body
