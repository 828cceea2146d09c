"""The client's operations: each builds one command of the service's API and decodes its result.

One definition serves every flavour of client (trio, asyncio, blocking): an operation is an ``Op`` (the
route, the body, how to read a success) and ``Operations`` turns each method call into an ``Op`` handed
to the flavour's ``perform``, which awaits it (trio, asyncio) or blocks for it (threads). A result with
a 4xx/5xx status raises ``CommandError`` carrying the service's own message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import attrs
import orjson

from kvrouter.client.compact import ADD, FREE, PREFILL_COMPLETE, json_body

T = TypeVar("T")
NO_BODY: Any = object()


class CommandError(Exception):
    """The service refused a command: ``status`` and its ``{"error"}`` message, as the HTTP route answers."""

    def __init__(self, status: int, message: str, body: Any = None, retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body
        self.retry_after = retry_after  # seconds, where the service sends Retry-After (429, 503 overloaded)


class StreamClosed(Exception):
    """The command stream is closed (the service went away, or refused the connection); commands still
    waiting for a result may or may not have been applied."""


@attrs.frozen
class Reply:
    """A command's status and JSON body, as the route answers (``call`` returns it without raising)."""

    status: int
    body: Any
    headers: dict[str, str] = attrs.Factory(dict)


@attrs.frozen
class Selection:
    """``/select`` and ``/select_and_reserve``: the chosen rank (``reservation_id`` when booked)."""

    worker_id: int
    dp_rank: int
    endpoint: str | None
    block_size: int
    overlap: dict[str, Any]  # the route's tier counts: {"longest_matched", "gpu", "dp", "cpu", "disk"}
    effective_prefill_tokens: int
    potential_decode_blocks: int
    model_name: str
    tenant_id: str
    selection_id: str | None = None
    reservation_id: str | None = None


@attrs.frozen
class Booking:
    """``POST /reservations``: what was booked and where."""

    reservation_id: str
    worker_id: int | None
    dp_rank: int | None
    endpoint: str | None
    model_name: str
    tenant_id: str


class Op(Generic[T]):
    """One operation: its route and body, how to read a success, and (for the slot tracker's hot writes) the
    positional command of the compact format (``client/compact.py``; the JSON body is derived from it)."""

    __slots__ = ("_body", "compact", "decode", "method", "path", "raises")

    def __init__(
        self,
        method: str,
        path: str,
        body: Any,
        decode: Callable[[Reply], T],
        raises: bool = True,  # a 4xx/5xx raises CommandError (``call`` returns every reply as it is)
        compact: tuple[Any, ...] | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self._body = body
        self.decode = decode
        self.raises = raises
        self.compact = compact

    @property
    def body(self) -> Any:
        """The route's body (``NO_BODY`` for none)."""
        if self.compact is not None:
            return json_body(self.compact[0], self.compact[1:])
        return self._body

    def __repr__(self) -> str:
        return f"Op({self.method} {self.path})"


def _reply(reply: Reply) -> Reply:
    return reply


def _created(reply: Reply) -> bool:
    return reply.status == 201


def _nothing(reply: Reply) -> None:
    return None


def _body(reply: Reply) -> Any:
    return reply.body


def _selection(reply: Reply) -> Selection:
    fields = attrs.fields_dict(Selection)
    return Selection(**{name: value for name, value in reply.body.items() if name in fields})


def _booking(reply: Reply) -> Booking:
    fields = attrs.fields_dict(Booking)
    return Booking(**{name: value for name, value in reply.body.items() if name in fields})


def raise_for(reply: Reply) -> Reply:
    """``reply`` if it is a success; else ``CommandError`` with the service's message."""
    if reply.status < 400:
        return reply
    body = reply.body
    message = body.get("error") if isinstance(body, dict) else body
    retry = reply.headers.get("retry-after")
    raise CommandError(reply.status, str(message), body, float(retry) if retry else None)


def _scoped(model_name: str, tenant_id: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    body = {"model_name": model_name, **{k: v for k, v in fields.items() if v is not None}}
    if tenant_id is not None:
        body["tenant_id"] = tenant_id
    return body


class Operations(ABC):
    """The typed operations; a flavour supplies ``perform`` (returning the decoded result, or an awaitable
    of it). Each method's docstring names what the result is."""

    @abstractmethod
    def perform(self, op: Op[Any]) -> Any:
        """Send ``op`` and return its decoded result (or an awaitable of it)."""

    def perform_write(self, path: str, command: tuple[Any, ...]) -> Any:
        """A slot tracker write (``/add``, ``/prefill_complete``, ``/free``) given as its compact ``command``
        -> bool: whether it created something. A flavour may send it without an ``Op`` (the hot path)."""
        return self.perform(Op("POST", path, None, _created, compact=command))

    def call(self, method: str, path: str, body: Any = NO_BODY) -> Any:
        """Any route: ``Reply`` (status, body, headers) without raising for a 4xx/5xx."""
        return self.perform(Op(method, path, body, _reply, raises=False))

    # -- the slot tracker ---------------------------------------------------------------------------------

    def register(
        self,
        worker_id: int,
        *,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        model_name: str = "default",
        tenant_id: str | None = None,
    ) -> Any:
        """``POST /register`` -> bool: whether the DP range was created (False: it was there already)."""
        fields = {"worker_id": worker_id, "block_size": block_size, "dp_start": dp_start, "dp_size": dp_size}
        return self.perform(Op("POST", "/register", _scoped(model_name, tenant_id, fields), _created))

    def unregister(self, worker_id: int, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /unregister`` -> bool."""
        body = _scoped(model_name, tenant_id, {"worker_id": worker_id})
        return self.perform(Op("POST", "/unregister", body, _created))

    def add(
        self,
        request_id: str,
        worker_id: int,
        sequence_hashes: Sequence[int],
        *,
        dp_rank: int = 0,
        new_isl_tokens: int | None = None,
        model_name: str = "default",
        tenant_id: str | None = None,
    ) -> Any:
        """``POST /add`` -> bool: whether the request was created."""
        hashes = sequence_hashes if type(sequence_hashes) in (list, tuple) else list(sequence_hashes)
        command = (ADD, model_name, tenant_id, request_id, worker_id, dp_rank, hashes, new_isl_tokens)
        return self.perform_write("/add", command)

    def prefill_complete(self, request_id: str, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /prefill_complete`` -> bool."""
        return self.perform_write("/prefill_complete", (PREFILL_COMPLETE, model_name, tenant_id, request_id))

    def free(self, request_id: str, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /free`` -> bool."""
        return self.perform_write("/free", (FREE, model_name, tenant_id, request_id))

    # -- the selection service ----------------------------------------------------------------------------

    def put_worker(self, worker: dict[str, Any]) -> Any:
        """``POST /workers`` (a worker record, as the route takes it) -> dict: the worker as listed."""
        return self.perform(Op("POST", "/workers", worker, _body))

    def remove_worker(self, worker_id: int) -> Any:
        """``DELETE /workers/{id}`` -> dict: the record it had."""
        return self.perform(Op("DELETE", f"/workers/{worker_id}", NO_BODY, _body))

    def select(self, request: dict[str, Any]) -> Any:
        """``POST /select`` (the route's body: prompt, model, options) -> ``Selection``; books nothing."""
        return self.perform(Op("POST", "/select", request, _selection))

    def select_and_reserve(self, request: dict[str, Any]) -> Any:
        """``POST /select_and_reserve`` -> ``Selection`` with its ``reservation_id``."""
        return self.perform(Op("POST", "/select_and_reserve", request, _selection))

    def reserve(self, reservation: dict[str, Any]) -> Any:
        """``POST /reservations`` (explicit booking, or ``selection_id`` replay) -> ``Booking``."""
        return self.perform(Op("POST", "/reservations", reservation, _booking))

    def reservation_prefill_complete(self, reservation_id: str) -> Any:
        """``POST /reservations/{id}/prefill_complete`` -> None."""
        path = f"/reservations/{quote(reservation_id, safe='')}/prefill_complete"
        return self.perform(Op("POST", path, NO_BODY, _nothing))

    def output_block(self, reservation_id: str, decay_fraction: float | None = None) -> Any:
        """``POST /reservations/{id}/output_block`` -> None."""
        body = {} if decay_fraction is None else {"decay_fraction": decay_fraction}
        path = f"/reservations/{quote(reservation_id, safe='')}/output_block"
        return self.perform(Op("POST", path, body, _nothing))

    def release(self, reservation_id: str) -> Any:
        """``DELETE /reservations/{id}`` -> None."""
        return self.perform(Op("DELETE", f"/reservations/{quote(reservation_id, safe='')}", NO_BODY, _nothing))


def result_of(op: Op[T], reply: Reply) -> T:
    """The decoded result of ``op``; a failure raises ``CommandError`` unless ``op`` takes every reply."""
    return op.decode(raise_for(reply) if op.raises else reply)


def result_of_parts(op: Op[T], status: int, body: Any, headers: dict[str, str] | None) -> T:
    """``result_of`` from a result's parts, ``body`` as the service sent it (JSON bytes are parsed here): a
    success whose meaning is its status alone (a slot tracker write) is decoded without a ``Reply``."""
    if op.decode is _created and status < 400:
        return status == 201  # type: ignore[return-value]
    if type(body) is bytes:
        body = orjson.loads(body)
    return result_of(op, Reply(status, body, {} if headers is None else headers))
