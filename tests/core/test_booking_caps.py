"""The per-scope caps on active requests (``actors/core/limits.py``), on the pure core: how many requests a scope
holds and how many prompt blocks they hold together, for the slot tracker's ``/add`` and every selection-service
booking. Refused before anything is journaled (409), never checked while a journal is replayed; the blocks are
counted as requests come and go (``SlotTracking.prompt_blocks``). The caps are patched small here."""

from __future__ import annotations

import pytest

from kvrouter.actors.core import decide as decide_module
from kvrouter.actors.core import selection_rules
from kvrouter.actors.core.commands import (
    AddRequest,
    ExpireStale,
    FreeRequest,
    Prompt,
    RegisterWorker,
    ReleaseReservation,
    RemoveWorker,
    Reserve,
    SelectDisaggregated,
    SelectWorker,
    UnregisterWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.limits import (
    MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE,
    MAX_ACTIVE_REQUESTS_PER_SCOPE,
    MAX_INDEX_BLOCKS_PER_SCOPE,
)
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import decode_record, digest, encode_record
from tests.core.test_scope_parts import TOKENS, record

SCOPE = ScopeKey("m", "default")
REQUESTS, BLOCKS = 4, 10  # the caps in these tests


def small_caps(monkeypatch: pytest.MonkeyPatch, requests: int = REQUESTS, blocks: int = BLOCKS) -> None:
    """Both caps, wherever the core reads them (the slot tracker's ``/add`` checks them inline)."""
    for module in (decide_module, selection_rules):
        monkeypatch.setattr(module, "MAX_ACTIVE_REQUESTS_PER_SCOPE", requests)
        monkeypatch.setattr(module, "MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE", blocks)


class Scope:
    """Drives the core like an actor: decide, journal and fold what was accepted, check every invariant."""

    def __init__(self) -> None:
        self.state = ScopeState(SCOPE)
        self.journal: list[bytes] = []

    def run(self, command: object) -> Accepted | Rejected:
        decision = decide(self.state, command)  # type: ignore[arg-type]
        if isinstance(decision, Accepted) and decision.events:
            self.journal.append(encode_record(SCOPE, decision.events))
            fold(self.state, decision.events)
        assert check(self.state) == [], command
        return decision

    def ok(self, command: object) -> Accepted:
        decision = self.run(command)
        assert isinstance(decision, Accepted), decision
        return decision

    def refused(self, command: object) -> str:
        """The command is refused with 409 and changes nothing: no record, the same state."""
        before, records = digest(self.state.to_snapshot()), len(self.journal)
        blocks = self.state.slots.prompt_blocks
        decision = self.run(command)
        assert isinstance(decision, Rejected) and decision.reason is Reason.CONFLICT, decision
        assert (digest(self.state.to_snapshot()), len(self.journal)) == (before, records)
        assert self.state.slots.prompt_blocks == blocks
        return decision.message


def add(request_id: str, blocks: int, worker: int = 1, rank: int = 0) -> AddRequest:
    return AddRequest(request_id, worker, rank, tuple(range(1000, 1000 + blocks)), 16)


def tracker(dp_size: int = 1) -> Scope:
    s = Scope()
    s.ok(RegisterWorker(1, 4, 0, dp_size))
    return s


def selection_scope() -> Scope:
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    return s


def test_the_defaults() -> None:
    assert MAX_ACTIVE_REQUESTS_PER_SCOPE == 1_048_576
    assert MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE == 8_388_608 == MAX_INDEX_BLOCKS_PER_SCOPE


def test_an_add_beyond_the_requests_cap_is_refused_and_a_free_makes_room(monkeypatch: pytest.MonkeyPatch) -> None:
    small_caps(monkeypatch, blocks=1000)
    s = tracker()
    for i in range(REQUESTS):
        s.ok(add(f"r{i}", 1))
    message = s.refused(add("one-more", 0))
    assert message == (
        f"model=m tenant_id=default has {REQUESTS} active requests; 1 more would exceed the limit of "
        f"{REQUESTS} active requests per scope; free requests first"
    )
    assert "one-more" not in s.state.slots.requests
    # An existing id is still answered as a duplicate (1.6.1's message), not as a full scope.
    assert "already exists" in s.refused(add("r0", 1))
    s.ok(FreeRequest("r1"))
    s.ok(add("one-more", 0))
    assert len(s.state.slots.requests) == REQUESTS


def test_an_add_beyond_the_prompt_blocks_cap_is_refused_and_a_free_makes_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small_caps(monkeypatch)
    s = tracker()
    s.ok(add("a", 6))
    s.ok(add("b", 3))  # the same hashes as a's first 3: counted again (each request holds its own)
    assert s.state.slots.prompt_blocks == 9
    message = s.refused(add("c", 2))
    assert message == (
        "model=m tenant_id=default's active requests hold 9 prompt blocks; 2 more would exceed the limit of "
        f"{BLOCKS} active prompt blocks per scope; free requests first"
    )
    s.ok(add("c", 1))  # exactly at the cap
    s.ok(add("empty", 0))  # a request of no blocks still fits (the requests cap bounds those)
    assert s.state.slots.prompt_blocks == BLOCKS
    s.ok(FreeRequest("a"))
    assert s.state.slots.prompt_blocks == 4
    s.ok(add("d", 6))


def test_expiry_releases_its_requests_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    small_caps(monkeypatch)
    s = tracker()
    s.ok(AddRequest("old", 1, 0, tuple(range(8)), 16, at=0))
    s.ok(AddRequest("new", 1, 0, (1, 2), 16, at=500))
    s.refused(add("c", 1))
    s.ok(ExpireStale(300, at=700))
    assert (list(s.state.slots.requests), s.state.slots.prompt_blocks) == (["new"], 2)
    s.ok(add("c", 8))


def test_unregistering_a_worker_releases_its_ranks_share(monkeypatch: pytest.MonkeyPatch) -> None:
    small_caps(monkeypatch)
    s = tracker(dp_size=2)
    s.ok(RegisterWorker(2, 4, 0, 1))
    s.ok(add("a", 4, rank=0))
    s.ok(add("b", 3, rank=1))
    s.ok(add("c", 2, worker=2))
    s.refused(add("d", 2, worker=2))
    s.ok(UnregisterWorker(1))
    assert (list(s.state.slots.requests), s.state.slots.prompt_blocks) == (["c"], 2)
    s.ok(add("d", 8, worker=2))


def test_a_catalog_change_that_drops_a_rank_releases_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    small_caps(monkeypatch)
    s = Scope()
    s.ok(UpsertWorker(record(1, data_parallel_size=2)))
    s.ok(UpsertWorker(record(2)))
    s.ok(Reserve("a", 1, 0, (1, 2, 3), isl_tokens=12))
    s.ok(Reserve("b", 1, 1, (1, 2, 3, 4), isl_tokens=16))
    s.ok(Reserve("c", 2, 0, (5, 6), isl_tokens=8))
    s.refused(Reserve("d", 2, 0, (7, 8), isl_tokens=8))
    s.ok(UpsertWorker(record(1, data_parallel_size=1)))  # rank 1 goes, with b
    assert (sorted(s.state.slots.requests), s.state.slots.prompt_blocks) == (["a", "c"], 5)
    s.ok(RemoveWorker(1))
    assert (list(s.state.slots.requests), s.state.slots.prompt_blocks) == (["c"], 2)
    s.ok(Reserve("d", 2, 0, tuple(range(8)), isl_tokens=32))


def test_every_selection_service_booking_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Reserve`` (and the replay of a pending selection, which books through it), a reserving ``/select`` and a
    disaggregated selection (two bookings at once); a selection that books nothing is never refused."""
    small_caps(monkeypatch)
    s = selection_scope()
    prompt = Prompt(TOKENS)  # 8 blocks of 4
    s.ok(SelectWorker(prompt, RouterConfig(), reserve=True, reservation_id="s1"))
    assert s.state.slots.prompt_blocks == 8
    assert "3 more would exceed the limit of 10 active prompt blocks" in s.refused(
        Reserve("r", 1, 0, (1, 2, 3), isl_tokens=12)
    )
    assert "8 more would exceed" in s.refused(SelectWorker(prompt, RouterConfig(), reserve=True, reservation_id="s2"))
    s.ok(SelectWorker(prompt, RouterConfig()))  # no booking
    # Without active-block tracking a booking holds no blocks, so only the requests cap applies.
    untracked = RouterConfig(router_track_active_blocks=False)
    s.ok(SelectWorker(prompt, untracked, reserve=True, reservation_id="s2"))
    s.ok(Reserve("r", 1, 0, (1, 2, 3), isl_tokens=12, track_active_blocks=False))
    assert len(s.state.slots.requests) == REQUESTS - 1
    # A disaggregated selection books two requests at once (its prefill and decode parts, both on the one
    # worker here): one place left is one too few.
    message = s.refused(SelectDisaggregated(prompt, untracked, "d"))
    assert "has 3 active requests; 2 more would exceed the limit of 4 active requests per scope" in message
    s.ok(ReleaseReservation("s2"))
    s.ok(SelectDisaggregated(prompt, untracked, "d"))


def test_the_count_survives_a_snapshot_and_a_journal_replay_under_any_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    s = tracker(dp_size=2)
    s.ok(add("a", 6, rank=0))
    s.ok(add("b", 4, rank=1))
    s.ok(add("c", 3, rank=1))
    s.ok(FreeRequest("b"))
    assert s.state.slots.prompt_blocks == 9
    restored = ScopeState.from_snapshot(s.state.to_snapshot())
    assert restored.slots.prompt_blocks == 9 and check(restored) == []
    # Replayed under caps lower than what the journal holds: evolve never checks them, so every request comes
    # back; new ones are refused until enough are freed.
    small_caps(monkeypatch, requests=1, blocks=5)
    replayed = ScopeState(SCOPE)
    for payload in s.journal:
        fold(replayed, decode_record(payload).events)
    assert (sorted(replayed.slots.requests), replayed.slots.prompt_blocks) == (["a", "c"], 9)
    assert digest(replayed.to_snapshot()) == digest(s.state.to_snapshot()) and check(replayed) == []
    s.state = replayed
    assert "limit of 1 active requests per scope" in s.refused(add("d", 0))
    s.ok(FreeRequest("a"))
    s.ok(FreeRequest("c"))
    s.ok(add("d", 5))


def test_the_invariant_check_catches_a_wrong_count() -> None:
    s = tracker()
    s.ok(add("a", 3))
    s.state.slots.prompt_blocks += 1
    assert check(s.state) == ["prompt block count 4, active requests hold 3"]
