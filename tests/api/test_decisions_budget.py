"""The decisions stream's service-wide budget (api/streams/decisions.py): however many subscribers, the hub hands them
at most its fan-out budget of decisions, conflated per filter into one shared chunk per read."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvrouter.actors.core.explanation import CandidateTerms, Explanation
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.decision_feed import DecisionBatch, DecisionRecord
from kvrouter.actors.service_support import ScopeFilter
from kvrouter.api.streams import decisions as live_decisions
from kvrouter.api.streams.decisions import DecisionHub
from kvrouter.api.streams.live import DEFAULT_STREAMS, Sender


def decision_records(first_seq: int, count: int) -> list[DecisionRecord]:
    candidates = [CandidateTerms(w, 0, 4, 0, 0, 0, 64, 960, 0, 0, 0, 1, cost=1.0) for w in range(16)]
    explanation = Explanation("kv", 0.0, 1024, 16, candidates, worker_id=0, dp_rank=0, reason="cache")
    scope = ScopeKey("m", "default")
    return [
        DecisionRecord(seq, 0, scope, True, None, f"r{seq}", "http://w0", {}, 960, 1, explanation)
        for seq in range(first_seq, first_seq + count)
    ]


async def test_decisions_to_many_subscribers_are_capped_service_wide() -> None:
    """250 subscribers while 400 selections are made in one read of the hub. Before, each subscriber got all 400
    (~1.5 KB each: 150 MB handed out, one task switch and send per decision and subscriber: lifecycles fell 69 %);
    now the subscribers together get at most a second of the hub's fan-out budget (the newest decisions, the rest
    counted as dropped)."""
    go = trio.Event()
    calls = 0

    async def fetch(epoch: str, cursor: int, wait: float) -> DecisionBatch:
        nonlocal calls
        calls += 1
        if calls == 1:
            return DecisionBatch("e", 0, 0, [])
        if calls == 2:
            await go.wait()
            return DecisionBatch("e", 400, 0, decision_records(1, 400))
        await trio.sleep_forever()
        raise AssertionError

    hub = DecisionHub(fetch)
    received = [0]

    async def send(message: dict[str, Any]) -> None:
        received[0] += len(message["text"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.pump.offer)
        for _ in range(250):
            nursery.start_soon(hub._stream, ScopeFilter(), Sender(send, DEFAULT_STREAMS))
        await trio.testing.wait_all_tasks_blocked()
        readies = received[0]
        go.set()
        await trio.testing.wait_all_tasks_blocked()
        handed = received[0] - readies
        assert handed < 10 * 1024 * 1024 and hub.counters.dropped > 250 * 300
        assert 0 < handed <= live_decisions.FAN_OUT_BYTES_PER_SECOND  # (at most a second's credit at once)
        nursery.cancel_scope.cancel()
