"""The client's side of reads that never go behind its own writes (a cluster's follower reads).

Each acknowledged write's answer from a cluster replica carries ``kvrouter-written: <scope token>:<sequence>``:
the sequence, on the scope's JetStream subject, that holds the write. ``WrittenTokens`` keeps the newest per scope
(at most ``MAX_SCOPES``; policy: forget the scope written least recently) and ``read_path`` adds to a read of
``/loads`` or ``/workers`` the query parameter ``read_after`` naming those of the scopes it reads (at most
``MAX_PER_READ``, the most recently written): a replica answering from a copy of such a scope answers only once
its copy holds that sequence, else the scope's owner answers.

The scope token is an unpadded URL-safe base64 of ``<length of model_name>:<model_name><tenant_id>``, which this
module reads back to match a read's ``model_name`` and ``tenant_id`` filters.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit

WRITTEN_HEADER: Final = "kvrouter-written"
READ_AFTER: Final = "read_after"
FOLLOWED_READS: Final = ("/loads", "/workers")
MAX_SCOPES: Final = 1024
MAX_PER_READ: Final = 64  # the service's limit per read


def token_scope(token: str) -> tuple[str, str] | None:
    """(model_name, tenant_id) of a scope token; None if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    length, colon, rest = raw.partition(":")
    if not colon or not length.isdigit() or int(length) > len(rest):
        return None
    return rest[: int(length)], rest[int(length) :]


class WrittenTokens:
    def __init__(self) -> None:
        self._newest: dict[str, int] = {}  # scope token -> sequence, least recently written first

    def note(self, headers: dict[str, str]) -> None:
        """Keep the token of an answer's headers, if it has one."""
        value = headers.get(WRITTEN_HEADER)
        if value is None:
            return
        token, _, seq = value.rpartition(":")
        if not token or not seq.isdigit():
            return
        known = self._newest.pop(token, 0)
        if len(self._newest) >= MAX_SCOPES:  # overflow: forget the scope written least recently
            del self._newest[next(iter(self._newest))]
        self._newest[token] = max(known, int(seq))

    def sequence(self, model_name: str, tenant_id: str = "default") -> int | None:
        """The newest sequence kept for the scope, if this client wrote to it."""
        for token, seq in self._newest.items():
            if token_scope(token) == (model_name, tenant_id):
                return seq
        return None

    def read_path(self, method: str, path: str) -> str:
        """``path`` with ``read_after`` for the scopes of this read written through this client (a read of
        ``/loads`` or ``/workers``); any other command's path as it is."""
        parts = urlsplit(path)
        if method != "GET" or parts.path not in FOLLOWED_READS or not self._newest:
            return path
        query = dict(parse_qsl(parts.query))
        model, tenant = query.get("model_name"), query.get("tenant_id", query.get("routing_group"))
        chosen = []
        for token in reversed(self._newest):
            scope = token_scope(token)
            if scope is not None and model in (None, scope[0]) and tenant in (None, scope[1]):
                chosen.append(f"{token}:{self._newest[token]}")
                if len(chosen) == MAX_PER_READ:
                    break
        if not chosen:
            return path
        extra = urlencode({READ_AFTER: ",".join(chosen)}, safe=":,")
        return f"{parts.path}?{parts.query}&{extra}" if parts.query else f"{parts.path}?{extra}"
