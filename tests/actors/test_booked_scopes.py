"""BookedScopes: the reservations booked through a replica and their scopes, bounded in bytes, the oldest
forgotten first; the ids a booking's answer names (a disaggregated selection's parts too)."""

from __future__ import annotations

from kvrouter.actors.cluster.booked_scopes import ENTRY_OVERHEAD, BookedScopes
from kvrouter.actors.core.ids import ScopeKey

A, B = ScopeKey("a", "default"), ScopeKey("b", "default")


def test_past_its_bound_the_reservations_noted_longest_ago_are_forgotten() -> None:
    scope_a = ENTRY_OVERHEAD + len("a") + len("default")  # each scope held once, whatever its reservations
    booked = BookedScopes(max_bytes=scope_a + 3 * (ENTRY_OVERHEAD + 2))
    for n in range(5):
        booked.note(f"r{n}", A)
    assert [booked.scope_of(f"r{n}") for n in range(5)] == [None, None, A, A, A]
    assert booked.forgotten == 2 and booked.bytes == scope_a + 3 * (ENTRY_OVERHEAD + 2)
    booked.note("x" * 10_000, B)  # larger than the whole bound: not noted, nothing forgotten for it
    assert booked.scope_of("x" * 10_000) is None and len(booked) == 3
    booked.forget("r3")
    booked.forget("r3")
    assert booked.scope_of("r3") is None and booked.bytes == scope_a + 2 * (ENTRY_OVERHEAD + 2)
    booked.forget("r2")
    booked.forget("r4")
    assert booked.bytes == 0 and len(booked) == 0  # the scope's names go with its last reservation


def test_a_scope_named_by_many_reservations_is_held_once() -> None:
    booked = BookedScopes()
    for n in range(100):
        booked.note(f"r{n}", ScopeKey("m" * 1000, "default"))  # a new but equal key from each request
    kept = {id(booked.scope_of(f"r{n}")) for n in range(100)}
    ids = sum(len(f"r{n}") for n in range(100))
    assert len(kept) == 1 and booked.bytes == 100 * ENTRY_OVERHEAD + ids + ENTRY_OVERHEAD + 1000 + len("default")


def test_a_bookings_answer_names_its_reservations() -> None:
    booked = BookedScopes()
    booked.note_answer({"worker_id": 1, "reservation_id": "one"}, A)
    booked.note_answer({"prefill": {"reservation_id": "p"}, "decode": {"reservation_id": "d"}}, B)
    booked.note_answer(None, A)
    booked.note_answer({"reservation_id": 7}, A)
    assert (booked.scope_of("one"), booked.scope_of("p"), booked.scope_of("d")) == (A, B, B)
    assert len(booked) == 3
    booked.note_answer({"reservation_id": "one"}, B)  # the same id booked again (in another scope): the newest
    assert booked.scope_of("one") == B and len(booked) == 3
