"""The decisions stream's service-wide budget (api/streams/decisions.py): however many subscribers, the hub hands them
at most its fan-out budget of decisions, conflated per filter into one shared chunk per read, and the service
explains no more selections than that budget can carry (actors/decision_feed.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kvrouter.actors.core.explanation import CandidateTerms, Explanation
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.decision_feed import DecisionBatch, DecisionRecord, Want
from kvrouter.actors.service_support import ScopeFilter
from kvrouter.api.streams import decisions as live_decisions
from kvrouter.api.streams.decisions import DecisionHub
from kvrouter.api.streams.live import DEFAULT_STREAMS, Sender
from tests.api.test_live_decisions import LAYOUTS, add_workers, decision, decisions, prompt, sample, selector


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
    delivered = False

    async def fetch(epoch: str, cursor: int, wait: float, wants: list[Want] | None, reader: str) -> DecisionBatch:
        nonlocal calls, delivered
        calls += 1
        if calls == 1:
            return DecisionBatch("e", 0, 0, [])
        if not delivered:  # (a poll the joining subscribers end is asked again)
            await go.wait()
            delivered = True
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


def explained_total(text: str) -> float:
    """``kvrouter_selections_explained_total`` over every reason."""
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvrouter_selections_explained_total{")
    )


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_subscriber_flood_does_not_make_the_service_explain_every_selection(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 subscribers of one filter share a fan-out budget of 50 KB/s here (1 KB/s each: about one decision a second
    for all of them). Before, while anyone read the stream, the service explained every selection (300 here), as
    costly as selecting, for decisions the hub then dropped; now it explains about what the hub can hand out, and
    numbers the rest (gaps, counted)."""
    monkeypatch.setattr(live_decisions, "FAN_OUT_BYTES_PER_SECOND", 50_000)
    async with selector(tmp_path, layout) as (service, http):
        await add_workers(http, 1, 2)
        async with contextlib.AsyncExitStack() as stack:
            subscribers = [await stack.enter_async_context(decisions(service)) for _ in range(50)]
            for i in range(300):
                assert (await http.post("/select", json=prompt(i * 100))).status_code == 200
            seen = await decision(subscribers[0])  # the first decisions are explained (and delivered) still
            text = (await http.get("/metrics")).text
    assert seen["type"] == "decision" and seen["explain"]["candidates"]
    explained = explained_total(text)
    assert 1 <= explained < 150
    assert explained + (sample(text, "kvrouter_decisions_not_explained_total") or 0.0) == 300


async def test_subscribers_whose_filters_match_nothing_have_nothing_explained(tmp_path: Path) -> None:
    """50 subscribers, each filtering on a model nobody selects for: no selection of model m is explained (before,
    every one was while they read)."""
    async with selector(tmp_path, "one-process") as (service, http):
        await add_workers(http, 1, 2)
        async with contextlib.AsyncExitStack() as stack:
            for i in range(50):
                await stack.enter_async_context(decisions(service, f"model_name=nobody-{i}"))
            for i in range(100):
                assert (await http.post("/select", json=prompt(i * 100))).status_code == 200
            text = (await http.get("/metrics")).text
    assert explained_total(text) == 0
    assert sample(text, "kvrouter_decisions_not_explained_total") == 100
