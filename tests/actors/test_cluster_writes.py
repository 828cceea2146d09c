"""A write of a batch that a cluster replica forwards goes as the body of its own route: read back by that route, it
is the same write (``write_body`` against the routes' own ``prepare``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvrouter.actors.cluster.membership import OwnerKey, View
from kvrouter.actors.cluster.service import write_body
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.api.http import Request
from kvrouter.api.routes.slot_tracker import (
    prepare_add,
    prepare_free,
    prepare_prefill_complete,
    prepare_register,
    prepare_unregister,
)

PREPARE = {
    "register": prepare_register,
    "unregister": prepare_unregister,
    "add": prepare_add,
    "prefill_complete": prepare_prefill_complete,
    "free": prepare_free,
}
WRITES: list[list[Any]] = [
    ["register", "m.x", "tenant 1", 7, 16, 0, 4],
    ["unregister", "m", "default", 7],
    ["add", "m", "t", "r-1", 7, 3, (1, 2**64 - 1), 48],
    ["prefill_complete", "m", "t", "r-1"],
    ["free", "m", "t", "r-1"],
]


@pytest.mark.parametrize("write", WRITES, ids=[write[0] for write in WRITES])
def test_a_forwarded_write_reads_back_as_itself(write: list[Any]) -> None:
    request = Request("POST", f"/{write[0]}", b"", write_body(write))
    assert PREPARE[write[0]](request) == write


def test_a_write_the_slot_tracker_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match="no write 'select'"):
        write_body(["select", "m", "t"])


def test_the_view_follows_the_cluster_keys_and_ignores_values_it_cannot_read() -> None:
    view = View()
    view.apply("members", "http://a:1", b'{"url": "http://a:1"}')
    view.apply("owners", "tok", b'{"member": "http://a:1", "lease": "42"}')
    view.apply("scopes", "tok", b'{"model_name": "m", "tenant_id": "t"}')
    view.apply("owners", "bad", b"not json")
    view.apply("elsewhere", "x", b"{}")
    assert view.members == {"http://a:1"}
    assert view.owners == {"tok": OwnerKey("http://a:1", 42)}
    assert view.scopes == {"tok": ScopeKey("m", "t")}
    view.apply("owners", "tok", None)  # the owner's lease ended
    view.apply("members", "http://a:1", None)
    assert view.owners == {} and view.members == set() and view.scopes == {"tok": ScopeKey("m", "t")}
