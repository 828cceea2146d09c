"""Reading an OpenAI-style request body from ASGI, shared by the mock worker and the frontend: JSON only,
bounded in bytes and in time, every refusal a ready ``{"error"}`` response."""

from __future__ import annotations

from typing import Any

import trio

from kvrouter.api.http import JSON, Response, error_response
from kvrouter.api.http.app import UNSUPPORTED_MEDIA

# What a chat's rendering adds to its texts (``<|role|>\n...\n`` per message, ``<|assistant|>\n`` at the end).
CHAT_MESSAGE_CHARS = 6
CHAT_CUE_CHARS = 14


class Refusal(Exception):
    """An answer decided before any byte of a response went out."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


async def read_json_body(
    scope: dict[str, Any], receive: Any, *, limit: int, arrival_seconds: float, too_large: str
) -> bytes:
    """The whole body of a JSON request: 415 for another type, 413 (``too_large``) past ``limit`` bytes (from a
    declared length before reading a byte), 408 if it takes longer than ``arrival_seconds``, 400 if the client
    goes away."""
    content_type = content_length = None
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            content_length = int(value) if value.isdigit() else None
    if content_type is None or content_type.split(b";", 1)[0].strip().lower() != JSON:
        raise Refusal(error_response(415, UNSUPPORTED_MEDIA))
    refused_as_too_large = Refusal(error_response(413, too_large))
    if content_length is not None and content_length > limit:
        raise refused_as_too_large
    chunks: list[bytes] = []
    size = 0
    late = Refusal(error_response(408, f"the request body did not arrive within {arrival_seconds:g} s"))
    deadline = trio.current_time() + arrival_seconds
    with trio.move_on_at(deadline) as reading:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # Past the deadline, a server's read timeout ended a client that is still there, only slow.
                raise late if trio.current_time() >= deadline else Refusal(error_response(400, "client disconnected"))
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise refused_as_too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    if reading.cancelled_caught:
        raise late
    return b"".join(chunks)


def prompt_size(body: dict[str, Any], *, chat: bool) -> tuple[int, int]:
    """``(characters, token ids)`` of a body's prompt, counted without building or tokenizing it (``len`` of each
    text): what a frontend checks before tokenizing. Fields of the wrong shape count 0 (the full check refuses
    them)."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return len(prompt), 0
        return 0, len(prompt) if isinstance(prompt, list) else 0
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0, 0
    chars = CHAT_CUE_CHARS
    for message in messages:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        chars += CHAT_MESSAGE_CHARS + (len(role) if isinstance(role, str) else 0)
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return chars, 0
