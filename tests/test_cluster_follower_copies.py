"""A follower copy in process, against a real nats-server with JetStream (free loopback port, stopped by PID), and
the tokens that keep reads behind no client's writes:

* a copy is built from the scope's subject, folds what is appended after, and answers a read naming the last
  sequence only once it holds it;
* the owner's snapshot purges messages the copy had not read: the copy sees the gap (a message starting past the
  next lsn) and is built again from the snapshot, with every record;
* ``read_after`` tokens are parsed strictly (400 material), and the client reads a scope token back to send only
  the tokens of the scopes a read covers.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from kvrouter.actors.cluster import followers as followers_module
from kvrouter.actors.cluster.follower_reads import parse_read_after
from kvrouter.actors.cluster.followers import FollowedCopy, Followers
from kvrouter.actors.cluster.scopes import ScopeJournals
from kvrouter.actors.core.events import RequestAdded, WorkerRegistered
from kvrouter.actors.core.evolve import evolve
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.queries import loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.actors.persistence.snapshots import encode_snapshot
from kvrouter.client.read_tokens import WrittenTokens, token_scope
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.store import Snapshot
from tests.support.fleet_servers import NatsServer, nats_server

__all__ = ["nats_server"]  # the fixture (tests/support)

STREAM = "FOLLOW_TEST"
SCOPE = ScopeKey("llama", "default")


class Owner:
    """The scope's journal as its owner writes it, and the state those records fold to."""

    def __init__(self, journal: JetStreamJournal) -> None:
        self.journal = journal
        self.state = ScopeState(SCOPE)

    async def write(self, *events: Any) -> int:
        for event in events:
            evolve(self.state, event)
        lsn = self.journal.append(encode_record(SCOPE, events))
        with trio.fail_after(10):
            await self.journal.wait_durable(lsn)
        return self.journal.statistics().last_stream_sequence

    async def snapshot(self) -> None:
        lsn = self.journal.statistics().last_lsn
        await self.journal.write_snapshot(Snapshot(lsn, encode_snapshot(lsn, [self.state.to_snapshot()])))


def prefill(copy: FollowedCopy) -> int:
    state = copy.state()
    assert state is not None
    return sum(rank.active_prefill_tokens for rank in loads(state))


async def ready_copy(followers: Followers, after_seq: int | None) -> FollowedCopy:
    """The copy once ready for a read naming ``after_seq`` (a read gets None while it is being built)."""
    with trio.fail_after(10):
        while True:
            copy = await followers.copy_for(SCOPE, after_seq)
            if copy is not None:
                return copy


def added(request_id: str, tokens: int) -> RequestAdded:
    return RequestAdded(request_id, 1, 1, (1,), tokens, 1)


async def test_a_copy_follows_the_subject_and_is_built_again_past_a_purged_gap(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    nats = nats_server.url
    monkeypatch.setattr(followers_module, "REFRESH_SECONDS", 3600.0)  # rounds only when a read asks for one
    opened = partial(JetStreamJournal.open, (nats,), STREAM, log=scope_token(SCOPE))
    journal = await trio.to_thread.run_sync(opened)
    followers = Followers(ScopeJournals((nats,), STREAM), served=lambda scope: False)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await nursery.start(followers.run)
        owner = Owner(journal)
        await owner.write(WorkerRegistered(1, 16, 0, 2), added("r0", 10))

        copy = await ready_copy(followers, None)
        assert prefill(copy) == 10 and followers.built == 1

        seq = await owner.write(added("r1", 10))
        copy = await ready_copy(followers, seq)  # behind the token: a round at once, then it holds it
        assert copy.seq >= seq and prefill(copy) == 20

        await owner.write(added("r2", 10))
        last = await owner.write(added("r3", 10))
        await owner.snapshot()  # purges r2's message, which the copy has not read (no round since)
        copy = await ready_copy(followers, last)
        assert prefill(copy) == 40
        assert followers.built == 2  # built again from the snapshot: the gap was seen, not skipped

        await journal.aclose()
        nursery.cancel_scope.cancel()


def test_read_after_tokens_are_parsed_strictly() -> None:
    token = scope_token(SCOPE)
    assert parse_read_after(f"{token}:7, {token}:9") == {token: 9}
    for bad in ("", "nosequence", f"{token}:", f"{token}:-1", f"{token}:1e3", ":5", f"{token}:{'9' * 20}"):
        with pytest.raises(ValueError, match="read_after"):
            parse_read_after(bad)
    with pytest.raises(ValueError, match="at most"):
        parse_read_after(",".join(f"{scope_token(ScopeKey(f'm{n}', 'default'))}:1" for n in range(65)))


def test_the_client_sends_the_tokens_of_the_scopes_a_read_covers() -> None:
    assert token_scope(scope_token(ScopeKey("a:b.c", "tenant 1"))) == ("a:b.c", "tenant 1")
    assert token_scope("not base64 at all!") is None
    written = WrittenTokens()
    llama, mistral = scope_token(ScopeKey("llama", "default")), scope_token(ScopeKey("mistral", "t2"))
    written.note({"kvrouter-written": f"{llama}:5"})
    written.note({"kvrouter-written": f"{mistral}:8"})
    written.note({"kvrouter-written": f"{llama}:3"})  # an older sequence never replaces a newer one
    assert written.sequence("llama") == 5
    assert written.read_path("GET", "/loads?model_name=llama") == f"/loads?model_name=llama&read_after={llama}:5"
    assert written.read_path("GET", "/workers?tenant_id=t2") == f"/workers?tenant_id=t2&read_after={mistral}:8"
    assert written.read_path("GET", "/loads?model_name=other") == "/loads?model_name=other"
    assert written.read_path("POST", "/add") == "/add"
    both = written.read_path("GET", "/loads")
    assert both == f"/loads?read_after={llama}:5,{mistral}:8"
