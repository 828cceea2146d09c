"""Self-registration with a selection service: ``POST {url}/workers`` at start, ``DELETE`` at shutdown.

Registration retries while the service cannot be reached or answers 5xx (``attempts`` in all, the wait
doubling from ``first_delay`` to ``max_delay``): a worker started alongside its router may come up first.
A 4xx is the service refusing this record (a bad model name, a worker id in use elsewhere): retrying cannot
help, so it fails at once with the service's own error text. The HTTP calls run in a worker thread (the
standard library's client; no HTTP client is a runtime dependency).
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any

import attrs
import orjson
import trio

log = logging.getLogger("kvrouter.mock_worker.registration")


class RegistrationFailed(Exception):
    """One line for the operator; ``refused``: the service answered 4xx (a configuration problem)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


@attrs.frozen
class Registration:
    url: str  # the selection service's base URL
    record: dict[str, Any]  # the POST /workers body
    attempts: int = 10
    first_delay: float = 0.25
    max_delay: float = 4.0
    timeout: float = 5.0
    token: str | None = attrs.field(default=None, repr=False)  # bearer token the service requires, if any

    @property
    def worker_id(self) -> int:
        return int(self.record["worker_id"])


def _call(method: str, url: str, body: Any, timeout: float, token: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else orjson.dumps(body)
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("content-type", "application/json")
    if token is not None:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def _error_text(body: bytes) -> str:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode("utf-8", "replace") or "(empty body)"
    if isinstance(value, dict) and isinstance(value.get("error"), str):
        return str(value["error"])
    return body[:200].decode("utf-8", "replace")


async def register(registration: Registration) -> dict[str, Any]:
    """POST the record; returns the service's answer (the catalog row). Raises ``RegistrationFailed``."""
    url = registration.url.rstrip("/") + "/workers"
    delay = registration.first_delay
    problem = ""
    for attempt in range(1, registration.attempts + 1):
        try:
            status, body = await trio.to_thread.run_sync(
                _call,
                "POST",
                url,
                registration.record,
                registration.timeout,
                registration.token,
                abandon_on_cancel=True,
            )
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out, malformed URL
            reason = getattr(exc, "reason", exc)
            problem = f"cannot reach it ({reason})"
        else:
            if 200 <= status < 300:
                row: dict[str, Any] = orjson.loads(body) if body else {}
                log.info("registered as worker %d with %s", registration.worker_id, registration.url)
                return row
            if 400 <= status < 500:
                raise RegistrationFailed(
                    f"the selection service at {registration.url} refused to register worker "
                    f"{registration.worker_id}: {status} {_error_text(body)}",
                    refused=True,
                )
            problem = f"it answered {status} {_error_text(body)}"
        if attempt < registration.attempts:
            log.info(
                "registration attempt %d/%d failed: %s; retrying in %g s",
                attempt,
                registration.attempts,
                problem,
                delay,
            )
            await trio.sleep(delay)
            delay = min(delay * 2, registration.max_delay)
    raise RegistrationFailed(
        f"cannot register with the selection service at {registration.url} after {registration.attempts} "
        f"attempts: {problem}; is it running there (--register)?",
        refused=False,
    )


async def unregister(registration: Registration) -> bool:
    """DELETE the worker, once; a failure is logged (the service's catalog keeps it until removed)."""
    url = f"{registration.url.rstrip('/')}/workers/{registration.worker_id}"
    try:
        status, body = await trio.to_thread.run_sync(
            _call, "DELETE", url, None, registration.timeout, registration.token, abandon_on_cancel=True
        )
    except (OSError, ValueError) as exc:
        log.warning(
            "could not unregister worker %d from %s (%s); remove it there with DELETE /workers/%d",
            registration.worker_id,
            registration.url,
            getattr(exc, "reason", exc),
            registration.worker_id,
        )
        return False
    if status == 404 or 200 <= status < 300:
        log.info("unregistered worker %d from %s", registration.worker_id, registration.url)
        return True
    log.warning(
        "could not unregister worker %d from %s: %d %s",
        registration.worker_id,
        registration.url,
        status,
        _error_text(body),
    )
    return False
