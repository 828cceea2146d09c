"""Session affinity (behaviour.md#loads-dump-and-session-affinity, 1.6.1's behaviour as probed), on the pure core: pin,
TTL, leases, replication."""

from __future__ import annotations

import pytest

from kvrouter.actors.core import session_rules
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    BindSession,
    ExpireStale,
    FreeRequest,
    Prompt,
    ReleaseReservation,
    Reserve,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted
from kvrouter.actors.core.events import SessionBound, SessionsExpired
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("llama", "default")
SECOND = 1_000_000_000
AFFINITY = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=2.0)


class Scope:
    def __init__(self, workers: int = 3) -> None:
        self.state = ScopeState(SCOPE)
        self.prompts = 0
        for worker_id in range(1, workers + 1):
            self.worker(worker_id)

    def ok(self, command) -> Accepted:
        decision = decide(self.state, command)
        assert isinstance(decision, Accepted), decision
        fold(self.state, decision.events)
        assert check(self.state) == []
        return decision

    def worker(self, worker_id: int, **fields) -> None:
        record = WorkerRecord(worker_id, "llama", "default", endpoint=f"http://w{worker_id}", block_size=4, **fields)
        self.ok(UpsertWorker(record, use_kv_events=False))

    def select(
        self, session: str | None, at: int = 0, reservation_id: str | None = None, config=AFFINITY, draw=0.0, **options
    ) -> Accepted:
        self.prompts += 1
        tokens = tuple(range(100 * self.prompts, 100 * self.prompts + 8))  # a fresh prompt each time
        command = SelectWorker(
            Prompt(token_ids=tokens),
            config,
            SelectionOptions(session_id=session, **options),
            reserve=reservation_id is not None,
            reservation_id=reservation_id,
            draw=draw,
            at=at,
            writer_id=42,
        )
        return self.ok(command)

    def chosen(self, session: str | None, at: int = 0, **options) -> set[int]:
        """The workers a query picks over draws spread across [0, 1): one worker when the session is pinned."""
        return {self.select(session, at, draw=d / 10, **options).reply.worker_id for d in range(10)}


def test_a_booking_pins_its_session_and_later_selections_prefer_the_pinned_worker() -> None:
    s = Scope()
    assert s.chosen(None) == {1, 2, 3}  # idle and cold: ties spread
    booked = s.select("chat", reservation_id="r1", draw=0.5)
    pinned = booked.reply.worker_id
    (bound,) = [e for e in booked.events if isinstance(e, SessionBound)]
    assert (bound.session_id, bound.worker_id, bound.reservation_id, bound.sequence, bound.writer_id) == (
        "chat",
        pinned,
        "r1",
        1,
        42,
    )
    assert s.chosen("chat") == {pinned}  # although it is now the busiest worker
    assert s.chosen("other") == {1, 2, 3} - {pinned}  # another session is not pinned (and avoids the busy one)


def test_a_query_never_pins() -> None:
    s = Scope()
    chosen = s.select("chat").reply.worker_id
    assert s.state.selection.sessions == {}
    assert s.chosen("chat") != {chosen}


def test_without_affinity_the_session_id_is_ignored() -> None:
    s = Scope()
    booked = s.select("chat", reservation_id="r1", config=RouterConfig(use_kv_events=False))
    assert not any(isinstance(e, SessionBound) for e in booked.events)
    assert s.state.selection.sessions == {}


def test_the_pin_holds_while_a_booking_lives_and_for_the_ttl_after_its_release() -> None:
    """1.6.1 with a 2 s TTL: held past 2 s while reserved; gone 2 s after the reservation was deleted."""
    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id
    assert s.chosen("chat", at=10 * SECOND) == {pinned}  # live booking: no idle time yet
    s.ok(ReleaseReservation("r1", at=20 * SECOND))
    assert s.chosen("chat", at=22 * SECOND) == {pinned}  # exactly the TTL: still pinned
    assert s.chosen("chat", at=22 * SECOND + 1) != {pinned}
    swept = s.ok(ExpireStale(10**15, at=22 * SECOND + 1)).events
    assert SessionsExpired(("chat",), 22 * SECOND + 1) in swept
    assert s.state.selection.sessions == {}


def test_the_sweep_keeps_a_session_whose_booking_it_expires_for_one_more_ttl() -> None:
    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id
    s.ok(ExpireStale(300 * SECOND, at=301 * SECOND))  # the booking is stale: released now
    assert "r1" not in s.state.slots.requests
    assert s.chosen("chat", at=302 * SECOND) == {pinned}
    s.ok(ExpireStale(300 * SECOND, at=304 * SECOND))
    assert s.state.selection.sessions == {}


def test_a_replica_free_releases_the_session_too() -> None:
    s = Scope()
    s.select("chat", reservation_id="r1")
    s.ok(FreeRequest("r1", at=5 * SECOND, remote=True))
    binding = s.state.selection.sessions["chat"]
    assert (binding.requests, binding.last_used) == (set(), 5 * SECOND)
    assert s.state.selection.session_of == {}


def test_an_ineligible_or_busy_pinned_worker_is_passed_over_and_the_pin_kept() -> None:
    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id
    others = {1, 2, 3} - {pinned}
    assert s.chosen("chat", allowed_worker_ids=frozenset(others)) <= others
    busy = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=2.0, active_prefill_tokens_threshold=4)
    assert s.select("chat", config=busy).reply.worker_id != pinned  # 8 prefill tokens > 4: busy
    assert s.chosen("chat") == {pinned}  # the pin is still there
    # A booking elsewhere (the pinned worker not allowed) moves the pin.
    moved = s.select("chat", reservation_id="r2", allowed_worker_ids=frozenset(others)).reply.worker_id
    assert s.chosen("chat") == {moved} and s.state.selection.sessions["chat"].sequence == 2


def test_a_pin_outlives_its_worker_and_returns_with_it() -> None:
    from kvrouter.actors.core.commands import RemoveWorker

    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id
    s.ok(RemoveWorker(pinned))
    assert pinned not in s.chosen("chat")
    s.worker(pinned)
    assert s.chosen("chat") == {pinned}


def test_the_replayed_reservation_pins_like_select_and_reserve() -> None:
    s = Scope()
    chosen = s.select("chat").reply  # a /select remembers what to book
    template = Reserve(
        "r1",
        chosen.worker_id,
        chosen.dp_rank,
        chosen.sequence_hashes,
        chosen.isl_tokens,
        session_id=chosen.session_id,
        session_ttl_ns=chosen.session_ttl_ns,
        writer_id=chosen.writer_id,
    )
    s.ok(template)
    assert s.chosen("chat") == {chosen.worker_id}


def test_peer_bindings_apply_when_newer() -> None:
    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id  # version (1, 42)
    other = next(w for w in (1, 2, 3) if w != pinned)
    assert decide(s.state, BindSession("chat", other, 0, sequence=1, writer_id=41, ttl_ns=SECOND)) == NOTHING_CHANGED
    assert decide(s.state, BindSession("chat", other, 0, sequence=1, writer_id=42, ttl_ns=SECOND)) == NOTHING_CHANGED
    s.ok(BindSession("chat", other, 0, sequence=1, writer_id=43, ttl_ns=SECOND, at=5 * SECOND))
    assert s.chosen("chat", at=5 * SECOND) == {other}
    # Our live booking of the session still holds it; once released, the peer's TTL runs.
    assert s.chosen("chat", at=60 * SECOND) == {other}
    s.ok(ReleaseReservation("r1", at=61 * SECOND))
    assert s.chosen("chat", at=62 * SECOND) == {other}
    assert s.chosen("chat", at=62 * SECOND + 1) != {other}
    # A binding for a session we never saw is taken as it is.
    s.ok(BindSession("new", other, 0, sequence=7, writer_id=1, ttl_ns=SECOND, at=5 * SECOND))
    assert session_rules.preferred_rank(s.state.selection, "new", 5 * SECOND, {}) == WorkerRank(other, 0)


def test_a_peer_binding_for_an_unknown_partition_changes_nothing() -> None:
    assert decide(ScopeState(SCOPE), BindSession("chat", 1, 0, 1, 1, SECOND)) == NOTHING_CHANGED


def test_sessions_beyond_the_limit_evict_the_least_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_rules, "MAX_SESSIONS", 2)
    s = Scope()
    s.select("a", reservation_id="ra", at=1)
    s.select("b", reservation_id="rb", at=2)
    s.select("a", reservation_id="ra2", at=3)  # a is used again: b is now the least recent
    events = s.select("c", reservation_id="rc", at=4).events
    assert SessionsExpired(("b",), 4) in events
    assert list(s.state.selection.sessions) == ["a", "c"]


def test_sessions_survive_a_snapshot_round_trip() -> None:
    s = Scope()
    s.select("a", reservation_id="ra", at=1)
    s.select("b", reservation_id="rb", at=2)
    s.ok(ReleaseReservation("rb", at=3))
    restored = ScopeState.from_snapshot(s.state.to_snapshot())
    assert restored.to_snapshot() == s.state.to_snapshot()
    assert restored.selection.session_of == {"ra": "a"}
    assert check(restored) == []


def test_versions_come_from_the_clock_and_a_refresh_keeps_its_version() -> None:
    """As 1.6.1's: a new or moved binding's sequence is the time (past the current one), so the latest binding
    wins across replicas; booking the session again on its rank republishes the same version."""
    s = Scope()
    pinned = s.select("chat", reservation_id="r1", at=7 * SECOND).reply.worker_id
    assert s.state.selection.sessions["chat"].version == (7 * SECOND, 42)
    s.select("chat", reservation_id="r2", at=9 * SECOND)  # a refresh on the pinned rank
    binding = s.state.selection.sessions["chat"]
    assert (binding.worker_id, binding.version, binding.last_used) == (pinned, (7 * SECOND, 42), 9 * SECOND)
    others = frozenset({1, 2, 3} - {pinned})
    s.select("chat", reservation_id="r3", at=9 * SECOND, allowed_worker_ids=others)  # moved: a new version
    assert s.state.selection.sessions["chat"].version == (9 * SECOND, 42)
    # A peer's binding (its clock ahead of ours) we refresh becomes ours, past its version (peers take ours).
    s.ok(BindSession("peer", pinned, 0, sequence=50 * SECOND, writer_id=99, ttl_ns=SECOND, at=10 * SECOND))
    s.select("peer", reservation_id="r4", at=11 * SECOND)
    assert s.state.selection.sessions["peer"].version == (50 * SECOND + 1, 42)


def test_the_same_peer_binding_again_restarts_its_idle_time() -> None:
    """1.6.1 republishes a binding, version unchanged, when a booking that held it ends."""
    s = Scope()
    s.ok(BindSession("chat", 2, 0, sequence=5, writer_id=43, ttl_ns=2 * SECOND, at=1 * SECOND))
    assert s.chosen("chat", at=3 * SECOND) == {2}
    s.ok(BindSession("chat", 2, 0, sequence=5, writer_id=43, ttl_ns=2 * SECOND, at=3 * SECOND))  # the touch
    assert s.chosen("chat", at=5 * SECOND) == {2}
    assert s.chosen("chat", at=5 * SECOND + 1) != {2}
    # Nothing older, nor the same version naming another rank, nor a touch from the past is taken.
    assert decide(s.state, BindSession("chat", 2, 0, 5, 43, 2 * SECOND, at=2 * SECOND)) == NOTHING_CHANGED
    assert decide(s.state, BindSession("chat", 3, 0, 5, 43, 2 * SECOND, at=4 * SECOND)) == NOTHING_CHANGED
    assert decide(s.state, BindSession("chat", 3, 0, 4, 99, 2 * SECOND, at=4 * SECOND)) == NOTHING_CHANGED


def test_an_explicit_pinned_worker_neither_follows_nor_moves_the_session() -> None:
    """1.6.1, probed: a booking with ``pinned_worker`` goes there and leaves the session's binding alone."""
    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id
    other = next(w for w in (1, 2, 3) if w != pinned)
    booked = s.select("chat", reservation_id="r2", pinned_worker=(other, 0))
    assert booked.reply.worker_id == other
    assert not any(isinstance(e, SessionBound) for e in booked.events)
    assert s.chosen("chat") == {pinned}


def test_an_affinity_target_takes_its_worker_while_it_is_eligible() -> None:
    """1.6.1's ``affinity_target``, as probed: the named worker (rank) over load and over a session's pin; a
    target that is unknown, not allowed or lacks a required taint is ignored; a pin elsewhere is refused."""
    from kvrouter.actors.core.decisions import Reason, Rejected

    s = Scope()
    pinned = s.select("chat", reservation_id="r1").reply.worker_id  # the pinned worker is now the busiest
    other = next(w for w in (1, 2, 3) if w != pinned)
    assert s.chosen(None, affinity_target=(pinned, None)) == {pinned}
    assert s.chosen("chat", affinity_target=(other, 0)) == {other}
    assert pinned not in s.chosen(None, affinity_target=(99, None))
    assert s.chosen(None, affinity_target=(pinned, None), allowed_worker_ids=frozenset({other})) == {other}
    refused = decide(
        s.state,
        SelectWorker(
            Prompt(token_ids=(1, 2, 3, 4)),
            AFFINITY,
            SelectionOptions(affinity_target=(pinned, None), pinned_worker=(other, 0)),
        ),
    )
    assert isinstance(refused, Rejected) and refused.reason is Reason.INVALID
    booked = s.select("chat", reservation_id="r2", affinity_target=(other, None))
    assert booked.reply.worker_id == other and not any(isinstance(e, SessionBound) for e in booked.events)
    assert s.chosen("chat") == {pinned}
