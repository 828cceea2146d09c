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
from kvrouter.api.schemas import DEFAULT_TENANT

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
    request_id = body.get("request_id")
    worker_id = body.get("worker_id")
    dp_rank = body.get("dp_rank")
    hashes = body.get("sequence_hashes")
    isl_tokens = body.get("new_isl_tokens", 0)
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
    scope = scope_of(body)
    if scope is None:
        return None
    return scope[0], scope[1], request_id, worker_id, dp_rank, unsigned, isl_tokens
