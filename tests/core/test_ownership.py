"""The ownership rules of a cluster (actors/core/ownership), as properties over random histories."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.commands import AddRequest, FreeRequest, RegisterWorker
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.claims import Claimed, ClaimTable, NoLease, Taken
from kvrouter.actors.core.ownership.fencing import Appended, SubjectLog, WrongLastSequence, scope_subject
from kvrouter.actors.core.ownership.forwarding import Forward, Serve, Unavailable, route
from kvrouter.actors.core.ownership.leases import LeaseTable, holder_deadline
from kvrouter.actors.core.ownership.owner import OwnedScope, Proposal, commit, overtaken, propose
from kvrouter.actors.core.ownership.placement import preferred_owner, share_of
from kvrouter.actors.core.ownership.recovery import recover, take_snapshot
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("llama", "t1")
names = st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=8)
members_st = st.lists(names, min_size=1, max_size=8, unique=True)
scopes_st = st.lists(names, min_size=1, max_size=40, unique=True)

# -- leases ---------------------------------------------------------------------------------------------


def test_a_lease_lives_until_its_ttl_unless_renewed() -> None:
    leases = LeaseTable()
    lease = leases.grant("a", 10, now=100)
    assert leases.live_members(109) == ("a",)
    assert leases.renew(lease.lease_id, 105) is not None  # now expires at 115
    assert leases.expire(114) == ()
    assert [g.lease_id for g in leases.expire(115)] == [lease.lease_id]
    assert leases.live_members(115) == ()


def test_a_renewal_after_expiry_fails_so_the_holder_must_take_a_new_lease() -> None:
    leases = LeaseTable()
    lease = leases.grant("a", 10, now=0)
    assert leases.renew(lease.lease_id, 10) is None
    assert leases.grant("a", 10, now=10).lease_id != lease.lease_id


def test_a_lease_needs_a_positive_ttl() -> None:
    with pytest.raises(ValueError, match="positive TTL"):
        LeaseTable().grant("a", 0, now=0)


@given(sent_at=st.integers(0, 10**12), delay=st.integers(0, 10**10), ttl=st.integers(1, 10**10))
def test_the_holder_deadline_never_outlives_the_coordinators_lease(sent_at: int, delay: int, ttl: int) -> None:
    """The coordinator grants when the request arrives (``sent_at + delay``): the holder stops first."""
    lease = LeaseTable().grant("a", ttl, now=sent_at + delay)
    assert holder_deadline(sent_at, ttl) <= lease.expires_at


# -- claims ---------------------------------------------------------------------------------------------


def test_the_first_claimant_wins_and_the_second_learns_who() -> None:
    leases, claims = LeaseTable(), ClaimTable()
    a, b = leases.grant("a", 10, 0), leases.grant("b", 10, 0)
    won = claims.claim("s", "a", a.lease_id, leases, 1)
    assert isinstance(won, Claimed)
    lost = claims.claim("s", "b", b.lease_id, leases, 2)
    assert isinstance(lost, Taken)
    assert lost.claim.owner == "a"


def test_a_claim_needs_the_claimants_own_live_lease() -> None:
    leases, claims = LeaseTable(), ClaimTable()
    a = leases.grant("a", 10, 0)
    assert isinstance(claims.claim("s", "b", a.lease_id, leases, 1), NoLease)  # someone else's lease
    assert isinstance(claims.claim("s", "a", a.lease_id, leases, 10), NoLease)  # expired
    assert claims.owner_of("s") is None


def test_a_key_goes_with_its_lease_and_the_next_owner_has_a_larger_revision() -> None:
    leases, claims = LeaseTable(), ClaimTable()
    a, b = leases.grant("a", 10, 0), leases.grant("b", 100, 0)
    first = claims.claim("s", "a", a.lease_id, leases, 1)
    assert isinstance(first, Claimed)
    assert claims.drop_leases(leases.expire(10)) == ("s",)
    second = claims.claim("s", "b", b.lease_id, leases, 11)
    assert isinstance(second, Claimed)
    assert second.claim.revision > first.claim.revision


def test_only_the_holder_releases_a_scope() -> None:
    leases, claims = LeaseTable(), ClaimTable()
    a, b = leases.grant("a", 10, 0), leases.grant("b", 10, 0)
    claims.claim("s", "a", a.lease_id, leases, 1)
    assert not claims.release("s", "b", b.lease_id)
    assert claims.release("s", "a", a.lease_id)
    assert claims.owner_of("s") is None


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_at_most_one_key_per_scope_and_only_under_live_leases(steps: list[tuple[str, int, int]]) -> None:
    """Members grant, renew and claim in any order while time moves on: a scope never has two holders, and a
    scope held after expiry is held under a live lease."""
    leases, claims = LeaseTable(), ClaimTable()
    now = 0
    held: dict[str, int] = {}
    for member, scope_no, advance in steps:
        now += advance
        claims.drop_leases(leases.expire(now))
        lease_id = held.get(member)
        if lease_id is None or leases.renew(lease_id, now) is None:
            lease_id = held[member] = leases.grant(member, 4, now).lease_id
        claims.claim(f"s{scope_no}", member, lease_id, leases, now)
        for _, claim in claims.snapshot():
            lease = leases.get(claim.lease_id)
            assert lease is not None and lease.live(now) and lease.member == claim.owner


# -- placement ------------------------------------------------------------------------------------------


@given(scopes_st, members_st, st.randoms())
def test_every_member_computes_the_same_owner_whatever_the_order(
    scopes: list[str], members: list[str], rnd: random.Random
) -> None:
    shuffled = list(members)
    rnd.shuffle(shuffled)
    for scope in scopes:
        owner = preferred_owner(scope, members)
        assert owner in members
        assert preferred_owner(scope, shuffled) == owner


@given(scopes_st, members_st, names)
def test_a_joining_member_takes_only_scopes_it_now_owns(scopes: list[str], members: list[str], newcomer: str) -> None:
    if newcomer in members:
        return
    for scope in scopes:
        before = preferred_owner(scope, members)
        after = preferred_owner(scope, [*members, newcomer])
        assert after in (before, newcomer)


@given(scopes_st, st.lists(names, min_size=2, max_size=8, unique=True), st.data())
def test_a_leaving_member_hands_over_only_its_own_scopes(
    scopes: list[str], members: list[str], data: st.DataObject
) -> None:
    leaving = data.draw(st.sampled_from(members))
    rest = [m for m in members if m != leaving]
    for scope in scopes:
        before = preferred_owner(scope, members)
        if before != leaving:
            assert preferred_owner(scope, rest) == before


def test_scopes_spread_over_members() -> None:
    scopes = [f"scope-{i}" for i in range(3_000)]
    members = ["replica-0", "replica-1", "replica-2"]
    shares = [len(share_of(m, scopes, members)) for m in members]
    assert sum(shares) == len(scopes)
    assert min(shares) > 900  # an even share is 1,000


def test_no_member_no_owner() -> None:
    assert preferred_owner("s", []) is None


# -- fencing --------------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.sampled_from("xyz"), st.integers(-1, 12)), max_size=60))
def test_an_append_lands_exactly_when_it_names_the_subjects_last_sequence(appends: list[tuple[str, int]]) -> None:
    log: SubjectLog[int] = SubjectLog()
    for n, (subject, expected) in enumerate(appends):
        last = log.last_subject_seq(subject)
        stream_last = log.last_seq
        result = log.append(subject, n, None if expected < 0 else expected)
        if expected < 0 or expected == last:
            assert result == Appended(stream_last + 1)
            assert log.last_subject_seq(subject) == stream_last + 1
        else:
            assert result == WrongLastSequence(expected, last)
            assert log.last_seq == stream_last and log.last_subject_seq(subject) == last
    for subject in log.subjects():
        seqs = [seq for seq, _ in log.read(subject, 0)]
        assert seqs == sorted(set(seqs))


def test_a_read_returns_the_tail_past_a_sequence_in_pages() -> None:
    log: SubjectLog[str] = SubjectLog()
    for n in range(10):
        log.append("a" if n % 2 else "b", str(n), None)
    assert [seq for seq, _ in log.read("a", 4)] == [6, 8, 10]
    assert [seq for seq, _ in log.read("a", 0, limit=2)] == [2, 4]
    assert log.read("nothing", 0) == ()


@given(st.text(max_size=20), st.text(max_size=20))
def test_a_scope_subject_is_one_valid_token_and_names_one_scope(model: str, tenant: str) -> None:
    subject = scope_subject("kvrouter.journal.C", ScopeKey(model, tenant))
    token = subject.removeprefix("kvrouter.journal.C.")
    assert token and not any(c in token for c in ".*> \t\r\n")
    assert scope_subject("kvrouter.journal.C", ScopeKey(model + "x", tenant)) != subject
    assert scope_subject("kvrouter.journal.C", ScopeKey(model, tenant + "x")) != subject


# -- the owner and recovery -----------------------------------------------------------------------------


def _apply(owned: OwnedScope, log: SubjectLog[tuple[object, ...]], command: object) -> bool:
    result = propose(owned, command)  # type: ignore[arg-type]
    if not isinstance(result, Proposal):
        return False
    appended = log.append("s", result.events, result.expected_last_seq)
    if isinstance(appended, Appended):
        commit(owned, result, appended.seq)
        return True
    return False


def _commands(n: int) -> list[object]:
    commands: list[object] = [RegisterWorker(1, 16, 0, 2)]
    for i in range(n):
        commands.append(AddRequest(f"r{i}", 1, i % 2, (i, i + 1), 32))
        if i % 3 == 2:
            commands.append(FreeRequest(f"r{i - 1}"))
    return commands


def test_a_stale_owner_is_fenced_and_changes_nothing() -> None:
    """Two replicas believe they own the scope (one was paused past its lease): the second to write is refused,
    and the subject folds to the state of the one that wrote."""
    log: SubjectLog[tuple[object, ...]] = SubjectLog()
    old = recover(SCOPE, None, ())
    assert _apply(old, log, RegisterWorker(1, 16, 0, 2))
    new = recover(SCOPE, None, log.read("s", 0))  # the next owner recovers from the subject
    assert _apply(new, log, AddRequest("r1", 1, 0, (1, 2), 32))
    assert not _apply(old, log, AddRequest("r1", 1, 1, (7,), 16))  # the stale owner's decision is refused
    assert old.last_seq == 1 and "r1" not in old.state.slots.requests  # nothing applied on refusal
    truth = recover(SCOPE, None, log.read("s", 0))
    assert truth.state.slots.requests["r1"].rank.dp_rank == 0


def test_a_rejected_or_empty_decision_proposes_nothing() -> None:
    owned = OwnedScope(ScopeState(SCOPE), 0)
    assert isinstance(propose(owned, AddRequest("r", 1, 0, (1,), 16)), Rejected)  # no such worker
    assert isinstance(propose(owned, FreeRequest("r")), Rejected | Accepted)


def test_commit_refuses_a_proposal_made_on_another_sequence() -> None:
    owned = OwnedScope(ScopeState(SCOPE), 0)
    proposal = propose(owned, RegisterWorker(1, 16, 0, 1))
    assert isinstance(proposal, Proposal)
    with pytest.raises(ValueError, match="commit at 0"):
        commit(owned, proposal, 0)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 30), snap_at=st.integers(0, 60))
def test_snapshot_plus_tail_recovers_the_owners_state(n: int, snap_at: int) -> None:
    log: SubjectLog[tuple[object, ...]] = SubjectLog()
    owner = recover(SCOPE, None, ())
    snapshot = None
    for step, command in enumerate(_commands(n)):
        _apply(owner, log, command)
        if step == snap_at:
            snapshot = take_snapshot(owner)
    recovered = recover(SCOPE, snapshot, log.read("s", snapshot.seq if snapshot else 0))
    assert recovered.last_seq == owner.last_seq
    assert recovered.state.to_snapshot() == owner.state.to_snapshot()


# -- forwarding -----------------------------------------------------------------------------------------


def test_forwarding_decisions() -> None:
    live = ("a", "b")
    assert route("s", "a", "a", live, serving=True) == Serve()
    assert isinstance(route("s", "a", "a", live, serving=False), Unavailable)  # recovering or lapsed
    assert route("s", "a", "b", live, serving=False) == Forward("b")
    assert isinstance(route("s", "a", "b", live, serving=False, forwarded=True), Unavailable)  # one hop only
    assert isinstance(route("s", "a", None, live, serving=False), Unavailable)
    dead_owner = route("s", "a", "c", live, serving=False)
    assert isinstance(dead_owner, Unavailable)
    assert dead_owner.status == 503 and dead_owner.body() == {"error": dead_owner.message}


def test_an_owner_is_overtaken_when_its_subject_moves_past_it_without_its_write() -> None:
    owned = OwnedScope(ScopeState(SCOPE), 7)
    assert not overtaken(owned, 7, appending=False)
    assert overtaken(owned, 8, appending=False)
    assert not overtaken(owned, 8, appending=True)  # that message may be its own append: its answer settles it
