"""The slot tracker's hottest bodies (``/add``, ``/prefill_complete``, ``/free``) read without cattrs when they
are well-formed: what they parse to is checked field by field here, at a fraction of the converter's cost.

A body these checks do not accept exactly as the strict converter would (a missing or extra-typed field, a
value out of range, an explicit null, a long string, a bad hash) gets ``None`` here, and the route parses it
with ``api/schemas.parse`` as before, which answers with the same result or the same error. So a body is
never answered differently because of this module: it only moves the common case off the converter
(``tests/api/test_write_bodies.py`` checks both ways agree on generated bodies).
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U32_MAX, U64_MASK
from kvrouter.actors.core.limits import MAX_PROMPT_BLOCKS, text_too_long
from kvrouter.api.bodies.schemas import DEFAULT_TENANT
from kvrouter.client.compact import from_int64s

_ABSENT: Any = object()


def scope_of(body: dict[str, Any]) -> tuple[str, str] | None:
    """(model, tenant) of a body, as ``Scoped.scope`` gives it; None for anything not plainly valid."""
    model = body.get("model_name")
    if type(model) is not str or text_too_long(model):
        return None
    tenant = body.get("tenant_id", _ABSENT)
    group = body.get("routing_group", _ABSENT)
    if tenant is _ABSENT and group is _ABSENT:
        return model, DEFAULT_TENANT
    for given in (tenant, group):
        if given is not _ABSENT and (type(given) is not str or text_too_long(given)):
            return None  # an explicit null, a non-string, a long one: the converter's answer
    return model, tenant if tenant is not _ABSENT else group


def request_ref(body: Any) -> tuple[str, str, str] | None:
    """(model, tenant, request_id) of a ``/prefill_complete`` or ``/free`` body, or None."""
    if type(body) is not dict:
        return None
    request_id = body.get("request_id")
    if type(request_id) is not str or text_too_long(request_id):
        return None
    scope = scope_of(body)
    if scope is None:
        return None
    return scope[0], scope[1], request_id


def add_request(body: Any) -> tuple[str, str, str, int, int, tuple[int, ...], int] | None:
    """(model, tenant, request_id, worker_id, dp_rank, sequence hashes as unsigned, new_isl_tokens) of an
    ``/add`` body, or None."""
    if type(body) is not dict:
        return None
    values = add_values(
        body.get("request_id"),
        body.get("worker_id"),
        body.get("dp_rank"),
        body.get("sequence_hashes"),
        body.get("new_isl_tokens", 0),
    )
    if values is None:
        return None
    scope = scope_of(body)
    if scope is None:
        return None
    return scope[0], scope[1], *values


def add_fields(
    model: Any, tenant: Any, request_id: Any, worker_id: Any, dp_rank: Any, hashes: Any, isl_tokens: Any
) -> tuple[str, str, str, int, int, tuple[int, ...], int] | None:
    """``add_request`` of the compact format's positional ``/add`` (``client/compact.py``: None for an absent
    tenant or new_isl_tokens; the hashes a list, or bytes of 64-bit integers), or None for anything the JSON
    body it stands for would not pass here."""
    if type(model) is not str or text_too_long(model):
        return None
    if tenant is None:
        tenant = DEFAULT_TENANT
    elif type(tenant) is not str or text_too_long(tenant):
        return None
    if type(hashes) is bytes:  # every 8 bytes an int64 by construction: only the count to check
        unsigned = from_int64s(hashes, signed=False) if len(hashes) <= 8 * MAX_PROMPT_BLOCKS else None
        if unsigned is None:
            return None
        values = add_values(request_id, worker_id, dp_rank, [], 0 if isl_tokens is None else isl_tokens)
        if values is None:
            return None
        return model, tenant, values[0], values[1], values[2], unsigned, values[4]
    values = add_values(request_id, worker_id, dp_rank, hashes, 0 if isl_tokens is None else isl_tokens)
    if values is None:
        return None
    return model, tenant, *values


def ref_fields(model: Any, tenant: Any, request_id: Any) -> tuple[str, str, str] | None:
    """``request_ref`` of the compact format's positional ``/prefill_complete`` and ``/free``, or None."""
    if type(model) is not str or text_too_long(model) or type(request_id) is not str or text_too_long(request_id):
        return None
    if tenant is None:
        return model, DEFAULT_TENANT, request_id
    if type(tenant) is not str or text_too_long(tenant):
        return None
    return model, tenant, request_id


def add_values(
    request_id: Any, worker_id: Any, dp_rank: Any, hashes: Any, isl_tokens: Any
) -> tuple[str, int, int, tuple[int, ...], int] | None:
    """The checked fields of an ``/add`` besides its scope (hashes as unsigned), or None."""
    if (
        type(request_id) is not str
        or type(worker_id) is not int
        or type(dp_rank) is not int
        or type(hashes) is not list
        or type(isl_tokens) is not int
    ):
        return None
    if not (0 <= worker_id <= U64_MASK and 0 <= dp_rank <= U32_MAX and 0 <= isl_tokens <= U64_MASK):
        return None
    if text_too_long(request_id) or len(hashes) > MAX_PROMPT_BLOCKS:
        return None
    if hashes:
        if set(map(type, hashes)) != {int}:
            return None
        low = min(hashes)
        if low < I64_MIN or max(hashes) > I64_MAX:
            return None
        unsigned = tuple(hashes) if low >= 0 else tuple([h & U64_MASK for h in hashes])
    else:
        unsigned = ()
    return request_id, worker_id, dp_rank, unsigned, isl_tokens
