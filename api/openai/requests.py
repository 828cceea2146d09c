"""The OpenAI request bodies the mock worker accepts, checked in full before anything runs.

``/v1/completions``: ``prompt`` is a text, a list of token ids (u32), or a one-element list of either;
``max_tokens`` (default 16) at least 1; ``stream``; ``stream_options.include_usage``; ``n`` only 1.
``/v1/chat/completions``: ``messages`` (each a ``role`` and a text ``content``, or a list of ``{"type": "text"}``
parts), ``max_completion_tokens`` or ``max_tokens``. ``model``, when given, must name the served model.
Other OpenAI fields (temperature, stop, ...) are accepted and ignored: the mock's output is fixed by its
prompt. A problem is a ``RequestProblem`` (the app answers 400, or 404 for an unknown model).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import attrs

from kvrouter.api.openai.tokenizer import render_chat, tokenize

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_TOKENS_LIMIT = 1 << 20  # a sanity bound; the real one is the KV capacity


class RequestProblem(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.frozen
class GenerateRequest:
    chat: bool
    prompt: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool


def parse_request(
    body: Any,
    *,
    chat: bool,
    model: str,
    tokenizer: Callable[[str], list[int]] = tokenize,
    forwarded: bool = False,
    render: Callable[[list[tuple[str, str]]], str] = render_chat,
) -> GenerateRequest:
    """The checked request; ``tokenizer`` turns texts into ids (the frontend may pass a model's own), ``render`` a
    chat's messages into the text tokenized (a frontend that renders with the model's template skips this one).

    ``forwarded``: checked by a frontend that forwards the body unchanged to a real worker, which answers what the
    mock cannot: ``n`` above 1 and content parts other than text (images, audio) pass here; only their text is
    tokenized for routing."""
    if not isinstance(body, dict):
        raise RequestProblem("the body must be a JSON object")
    named = body.get("model")
    if named is not None:
        if not isinstance(named, str):
            raise RequestProblem("model must be a string")
        if named != model:
            raise RequestProblem(f"model {named!r} not found; this worker serves {model!r}", 404)
    n = body.get("n")
    if n is not None and not forwarded and (not _is_int(n) or n != 1):
        raise RequestProblem("n must be 1: the mock worker generates one choice per request")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestProblem("stream must be true or false")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestProblem("stream_options must be an object")
        usage = options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise RequestProblem("stream_options.include_usage must be true or false")
        include_usage = usage
    if chat:
        prompt = tokenizer(render(_messages(body.get("messages"), forwarded)))
        max_tokens = _max_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _max_tokens(body, "max_tokens")
    else:
        prompt = _prompt(body.get("prompt"), tokenizer)
        max_tokens = _max_tokens(body, "max_tokens")
    if not prompt:
        raise RequestProblem("the prompt is empty: it must have at least one token")
    return GenerateRequest(
        chat, prompt, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, stream, include_usage
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_tokens(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise RequestProblem(f"{field} must be an integer from 1 to {MAX_TOKENS_LIMIT}, got {_show(value)}")
    return int(value)


def _prompt(value: Any, tokenizer: Callable[[str], list[int]]) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return tokenizer(value)
    if isinstance(value, list):
        if any(isinstance(item, str | list) for item in value):
            raise RequestProblem("prompt: one prompt per request (a text or a list of token ids), not a batch")
        try:
            if any(isinstance(item, bool) for item in value):
                raise TypeError
            return list(array("I", value))
        except (TypeError, OverflowError):
            raise RequestProblem("prompt: token ids must be integers from 0 to 4294967295") from None
    if value is None:
        raise RequestProblem("prompt is required: a text or a list of token ids")
    raise RequestProblem(f"prompt must be a text or a list of token ids, got {_show(value)}")


def _messages(value: Any, forwarded: bool = False) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestProblem("messages must be a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestProblem(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestProblem(f"messages[{i}].role must be a non-empty string")
        out.append((role, _content(content, i, forwarded)))
    return out


def _content(content: Any, i: int, forwarded: bool) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if forwarded and isinstance(part, dict) and part.get("type") != "text":
                continue  # an image or audio part: the worker reads it; routing hashes the text
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestProblem(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestProblem(f"messages[{i}].content must be a string or a list of text parts")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
