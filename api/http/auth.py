"""Optional bearer-token authentication for the HTTP API.

The token comes from a file (``--auth-token-file`` or ``KVROUTER_AUTH_TOKEN_FILE``), never from the
command line, where ``ps`` and shell histories would show it. Requests present it as
``Authorization: Bearer <token>``; the comparison takes the same time whatever the presented value
(both sides are hashed to fixed-length digests, then compared with ``hmac.compare_digest``), and the
token is never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from kvrouter.api.http import Response, error_response

TOKEN_FILE_ENV = "KVROUTER_AUTH_TOKEN_FILE"
MAX_TOKEN_FILE_BYTES = 4096
REALM = b'Bearer realm="kvrouter"'
MISSING = "this route requires a bearer token: send `Authorization: Bearer <token>`"
INVALID = "the bearer token is not valid"


class TokenFileError(ValueError):
    """The token file cannot be used; ``str`` is one line naming the file and what to do."""


class BearerToken:
    """The service's token: requests are checked against its digest. The token itself is kept for the one place
    that presents it, a cluster replica forwarding a command to another (the replicas share the token)."""

    def __init__(self, token: bytes) -> None:
        if not token:
            raise ValueError("an empty bearer token")
        self._digest = hashlib.sha256(token).digest()
        self._token = token

    def authorization(self) -> str:
        """The ``Authorization`` header value that presents this token (never logged)."""
        return "Bearer " + self._token.decode("ascii")

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"

    @classmethod
    def from_file(cls, path: Path, source: str = "--auth-token-file") -> BearerToken:
        """The token in ``path``: its text without surrounding whitespace (a trailing newline is usual).

        Raises :class:`TokenFileError` for a file that cannot be read, is empty, too large, or holds
        whitespace or non-ASCII characters inside the token (they cannot travel in a header intact).
        """
        try:
            with open(path, "rb") as file:
                raw = file.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise TokenFileError(f"{source}={str(path)!r} cannot be read ({exc.strerror or exc})") from None
        if len(raw) > MAX_TOKEN_FILE_BYTES:
            raise TokenFileError(
                f"{source}={str(path)!r} is larger than {MAX_TOKEN_FILE_BYTES} bytes; it must hold the token only"
            )
        token = raw.strip()
        if not token:
            raise TokenFileError(
                f"{source}={str(path)!r} is empty; write the token into it (e.g. openssl rand -hex 32)"
            )
        if not all(0x21 <= byte <= 0x7E for byte in token):
            raise TokenFileError(
                f"{source}={str(path)!r} holds spaces, control or non-ASCII characters inside the token; "
                "use printable ASCII only (e.g. openssl rand -hex 32)"
            )
        return cls(token)

    def admits(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries this token (scheme ``Bearer``, any case)."""
        if authorization is None:
            return False
        scheme, _, presented = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(presented.strip()).digest(), self._digest)

    @staticmethod
    def refusal(authorization: bytes | None) -> Response:
        """401 with the challenge RFC 6750 describes; says whether a token was missing or wrong."""
        if authorization is None:
            return error_response(401, MISSING, ((b"www-authenticate", REALM),))
        return error_response(401, INVALID, ((b"www-authenticate", REALM + b', error="invalid_token"'),))


def readable_by_others(path: Path) -> bool:
    """Whether users other than the owner may read the token file (worth a warning, not a refusal)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))
    except OSError:
        return False
