"""What explaining selections costs (issue 11): CPU per ``/select`` query in the scope actor, in-process, with
nobody reading ``/ws/decisions`` (the path every selection takes), with a reader (each selection explained and
published), with a hub of 250 subscribers reading (its explanation budget: ~6.5 a second), and with
``"explain": true``; next to the same query without the explanation hook at all (the code
before issue 11), so the first two figures show what the hook costs when nobody subscribes.

    .venv/bin/python benchmarks/explain_bench.py [--repeat 7] [--number 2000]

Workload: core_hot_paths_bench's selection (16 workers, block size 16, 64-block chains indexed, 64-block
prompts sharing a random prefix, some ranks busy). CPU time, best of ``--repeat`` rounds, the variants
interleaved round by round (in alternating order) so a busy machine moves them alike.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_hot_paths_bench import BLOCK, CHAIN_BLOCKS, WORKERS, selection_state

from kvrouter.actors.actor import ActorPorts, ScopeActor
from kvrouter.actors.core.commands import Prompt, SelectWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.pending import PendingSelections
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.decision_feed import DecisionFeed, Want
from kvrouter.actors.service_support import EVERY_SCOPE


def query_before(actor: ScopeActor, command: SelectWorker) -> Any:
    """``ScopeActor.query`` without the explanation hook: the desk's steps around ``decide`` alone."""
    prepared = actor.desk.prepare(command)
    assert isinstance(prepared, SelectWorker)
    return actor.desk.decided(command, prepared, decide(actor.state, prepared), None)


def prompts(rng: random.Random, chains: list[list[int]], explain: bool) -> list[SelectWorker]:
    config = RouterConfig()
    made = []
    for i in range(64):
        chain = chains[i % WORKERS]
        shared = rng.randint(0, CHAIN_BLOCKS) * BLOCK
        tokens = chain[:shared] + [rng.randrange(1 << 31) for _ in range(CHAIN_BLOCKS * BLOCK - shared)]
        made.append(SelectWorker(Prompt(token_ids=tuple(tokens)), config, explain=explain))
    return made


async def run(repeat: int, number: int) -> dict[str, float]:
    rng = random.Random(1)
    state, chains = selection_state(rng)
    feed = DecisionFeed()
    ports = ActorPorts(None, [], lambda: None, lambda actor: None, decisions=feed)  # type: ignore[arg-type]
    actor = ScopeActor(state, ports, random.Random(2), PendingSelections())
    plain, explained = prompts(rng, chains, False), prompts(rng, chains, True)

    def before(i: int) -> None:
        assert isinstance(query_before(actor, plain[i % 64]), Accepted)

    def nobody(i: int) -> None:
        assert isinstance(actor.query(plain[i % 64]), Accepted)

    def subscribed(i: int) -> None:
        feed.lease(3600.0)
        assert isinstance(actor.query(plain[i % 64]), Accepted)

    def flooded(i: int) -> None:
        feed.lease(3600.0, [Want(EVERY_SCOPE, 6.5)])  # what a hub of 250 subscribers of one filter asks for
        assert isinstance(actor.query(plain[i % 64]), Accepted)

    def asked(i: int) -> None:
        feed.leased = False  # nobody reads the feed; the request asks
        assert isinstance(actor.query(explained[i % 64]), Accepted)

    variants = {
        "before the hook": before,
        "nobody subscribes": nobody,
        "a /ws/decisions reader": subscribed,
        "250 readers' budget": flooded,
        '"explain": true': asked,
    }
    best = dict.fromkeys(variants, float("inf"))
    for round_index in range(repeat):
        order = list(variants.items())
        for name, one in order if round_index % 2 else reversed(order):  # alternate: no variant always first
            if name not in ("a /ws/decisions reader", "250 readers' budget"):
                feed.leased = False
            started = time.process_time()
            for i in range(number):
                one(i)
            best[name] = min(best[name], (time.process_time() - started) / number * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    best = trio.run(run, args.repeat, args.number)
    base = best["before the hook"]
    for name, micros in best.items():
        print(f"{name:<24} {micros:8.1f} us per selection  ({micros / base:5.3f} x before)")


if __name__ == "__main__":
    main()
