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
from urllib.parse import quote, urlencode

import attrs
import orjson

from kvrouter.client.compact import ADD, FREE, PATHS, PREFILL_COMPLETE, json_body
from kvrouter.client.table import BY_NAME

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

    def every_reply(self, path: str | None = None) -> Op[Reply]:
        """The same command (to ``path`` if given), each of its replies returned as a ``Reply`` without raising
        (for a client that decides on the status itself before decoding with this ``Op``: ``result_of``)."""
        return Op(self.method, path or self.path, self._body, _reply, raises=False, compact=self.compact)

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

    def operation(self, name: str, body: Any = NO_BODY, decode: Callable[[Reply], Any] = _body, **path: str) -> Any:
        """Operation ``name`` of the table (``kvrouter.client.table``) with ``body`` and its path parameters;
        the result as ``decode`` reads a success (a 4xx/5xx raises ``CommandError``)."""
        op = BY_NAME[name]
        target = op.path.format_map({key: quote(str(value), safe="") for key, value in path.items()})
        return self.perform(Op(op.method, target, body, decode))

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
        return self.operation("register", _scoped(model_name, tenant_id, fields), _created)

    def unregister(self, worker_id: int, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /unregister`` -> bool."""
        return self.operation("unregister", _scoped(model_name, tenant_id, {"worker_id": worker_id}), _created)

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
        return self.perform_write(PATHS[ADD], command)

    def prefill_complete(self, request_id: str, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /prefill_complete`` -> bool."""
        return self.perform_write(PATHS[PREFILL_COMPLETE], (PREFILL_COMPLETE, model_name, tenant_id, request_id))

    def free(self, request_id: str, *, model_name: str = "default", tenant_id: str | None = None) -> Any:
        """``POST /free`` -> bool."""
        return self.perform_write(PATHS[FREE], (FREE, model_name, tenant_id, request_id))

    # -- both services ------------------------------------------------------------------------------------

    def workers(self, *, model_name: str | None = None, tenant_id: str | None = None) -> Any:
        """``GET /workers`` -> list: the registered workers (each service lists them in its own shape)."""
        return self._read("workers", model_name, tenant_id)

    def loads(self, *, model_name: str | None = None, tenant_id: str | None = None) -> Any:
        """``GET /loads`` -> list: every rank's load (slot tracker: rows; selection service: per partition)."""
        return self._read("loads", model_name, tenant_id)

    def potential_loads(self, request: dict[str, Any]) -> Any:
        """``POST /potential_loads`` -> list: what each rank would carry with this prompt."""
        return self.operation("potential_loads", request)

    def cluster(self) -> Any:
        """``GET /cluster`` -> dict: the replica's lease, the live members and each scope's owner."""
        return self.operation("cluster")

    def health(self) -> Any:
        """``GET /health`` -> None (raises if the service does not answer 200)."""
        return self.operation("health", decode=_nothing)

    def metrics(self) -> Any:
        """``GET /metrics`` -> str: the service's figures in Prometheus's text format."""
        return self.operation("metrics")

    def openapi(self) -> Any:
        """``GET /openapi.json`` -> dict: the service's OpenAPI document."""
        return self.operation("openapi")

    def batch(self, commands: list[dict[str, Any]]) -> Any:
        """``POST /batch`` -> list of ``{"status", "body"}``: each command answered as on its own route."""
        return self.operation("batch", commands)

    def register_peer(self, endpoint: str) -> Any:
        """``POST /replica_sync/register_peer`` -> bool: whether the peer was added."""
        return self.operation("register_peer", {"endpoint": endpoint}, _created)

    def deregister_peer(self, endpoint: str) -> Any:
        """``POST /replica_sync/deregister_peer`` -> None."""
        return self.operation("deregister_peer", {"endpoint": endpoint}, _nothing)

    def peers(self) -> Any:
        """``GET /replica_sync/peers`` -> list of the replica peers' endpoints."""
        return self.operation("peers")

    # -- the selection service ----------------------------------------------------------------------------

    def put_worker(self, worker: dict[str, Any]) -> Any:
        """``POST /workers`` (a worker record, as the route takes it) -> dict: the worker as listed."""
        return self.operation("put_worker", worker)

    def patch_worker(self, worker_id: int, fields: dict[str, Any]) -> Any:
        """``PATCH /workers/{id}`` (the fields to change) -> dict: the worker as listed."""
        return self.operation("patch_worker", fields, worker_id=str(worker_id))

    def remove_worker(self, worker_id: int) -> Any:
        """``DELETE /workers/{id}`` -> dict: the record it had."""
        return self.operation("remove_worker", worker_id=str(worker_id))

    def ready(self) -> Any:
        """``GET /ready`` -> dict: whether any worker is schedulable (a 503 raises ``CommandError``)."""
        return self.operation("ready")

    def select(self, request: dict[str, Any]) -> Any:
        """``POST /select`` (the route's body: prompt, model, options) -> ``Selection``; books nothing."""
        return self.operation("select", request, _selection)

    def select_and_reserve(self, request: dict[str, Any]) -> Any:
        """``POST /select_and_reserve`` -> ``Selection`` with its ``reservation_id``."""
        return self.operation("select_and_reserve", request, _selection)

    def select_disaggregated(self, request: dict[str, Any]) -> Any:
        """``POST /select_disaggregated`` -> dict: the prefill and decode bookings."""
        return self.operation("select_disaggregated", request)

    def reserve(self, reservation: dict[str, Any]) -> Any:
        """``POST /reservations`` (explicit booking, or ``selection_id`` replay) -> ``Booking``."""
        return self.operation("reserve", reservation, _booking)

    def reservation_prefill_complete(self, reservation_id: str) -> Any:
        """``POST /reservations/{id}/prefill_complete`` -> None."""
        return self.operation("reservation_prefill_complete", decode=_nothing, reservation_id=reservation_id)

    def output_block(self, reservation_id: str, decay_fraction: float | None = None) -> Any:
        """``POST /reservations/{id}/output_block`` -> None."""
        body = {} if decay_fraction is None else {"decay_fraction": decay_fraction}
        return self.operation("output_block", body, _nothing, reservation_id=reservation_id)

    def release(self, reservation_id: str) -> Any:
        """``DELETE /reservations/{id}`` -> None."""
        return self.operation("release", decode=_nothing, reservation_id=reservation_id)

    def overlap_scores(self, request: dict[str, Any]) -> Any:
        """``POST /overlap_scores`` -> dict: each worker's cached prefix of the prompt."""
        return self.operation("overlap_scores", request)

    def dump(self) -> Any:
        """``GET /dump`` -> dict: every scope's KV index in the standalone indexer's recovery format."""
        return self.operation("dump")

    def _read(self, name: str, model_name: str | None, tenant_id: str | None) -> Any:
        op = BY_NAME[name]
        query = urlencode({k: v for k, v in (("model_name", model_name), ("tenant_id", tenant_id)) if v is not None})
        return self.perform(Op(op.method, f"{op.path}?{query}" if query else op.path, NO_BODY, _body))


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
