"""permessage-deflate with a bound on what a message inflates to (every WebSocket route of both services).

Hypercorn accepts permessage-deflate from any client that offers it, and wsproto inflates each compressed frame
in full (``zlib``'s ``decompress`` without a bound) before hypercorn's ``websocket_max_message_size`` (1 MiB,
``api/server.py``) is checked: a 1 MiB frame of deflated zeros inflates to ~1 GiB, so a client could make the
service hold a gigabyte per megabyte it sent before the connection was closed with 1009 (measured: a slot
tracker went from 76 MiB to 2 GiB resident after three such messages). ``BoundedPerMessageDeflate`` inflates a
message's frames at most one byte past the bound, then fails the connection with 1009 (MESSAGE_TOO_BIG), as
hypercorn does for an uncompressed message over it. ``bound_inflation`` puts it where hypercorn's handshake
looks its extension class up (``hypercorn.protocol.ws_stream.PerMessageDeflate``, at each upgrade); with a
hypercorn that names it otherwise nothing is changed.
"""

from __future__ import annotations

import zlib
from typing import Any

from hypercorn.protocol import ws_stream
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol, Opcode, RsvBits


class BoundedPerMessageDeflate(PerMessageDeflate):
    """wsproto's permessage-deflate, inflating a message to at most ``max_message_bytes`` (+1, to tell)."""

    max_message_bytes = 1 << 20  # set by ``bound_inflation`` to hypercorn's websocket_max_message_size

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inflated = 0  # bytes the current message has inflated to so far

    def frame_inbound_header(
        self, proto: FrameDecoder | FrameProtocol, opcode: Opcode, rsv: RsvBits, payload_length: int
    ) -> CloseReason | RsvBits:
        if self._inbound_compressed is None:  # a message's first frame (or a control frame between messages)
            self._inflated = 0
        return super().frame_inbound_header(proto, opcode, rsv, payload_length)

    def frame_inbound_payload_data(self, proto: FrameDecoder | FrameProtocol, data: bytes) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        assert self._decompressor is not None
        room = self.max_message_bytes - self._inflated
        try:
            inflated = self._decompressor.decompress(bytes(data), room + 1)  # (0 would mean no bound)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(inflated)
        if self._inflated > self.max_message_bytes:
            return CloseReason.MESSAGE_TOO_BIG
        return inflated


def bound_inflation(max_message_bytes: int) -> None:
    """Hypercorn's WebSocket handshakes from now on offer ``BoundedPerMessageDeflate`` bounded at
    ``max_message_bytes`` (its ``websocket_max_message_size``)."""
    BoundedPerMessageDeflate.max_message_bytes = max_message_bytes
    if getattr(ws_stream, "PerMessageDeflate", None) in (PerMessageDeflate, BoundedPerMessageDeflate):
        ws_stream.PerMessageDeflate = BoundedPerMessageDeflate  # type: ignore[misc]
