"""Runs a seeded trace through the real actor shell under trio's MockClock with a MemoryJournal.

The driver is serialised (the next command is sent after the previous reply), so each scope's
mailbox order, and therefore the journal, is a pure function of the seed. Crashes are injected by
dropping the live system and recovering a new one from what the journal holds.
"""

from __future__ import annotations

import random

import attrs
import trio
import trio.testing

from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from kvrouter.simulations.checkers import invariant_failures, journal_digest, replay_mismatch, states_digest
from kvrouter.simulations.workload import WorkloadOptions, trace


@attrs.frozen
class SimulationResult:
    seed: int
    steps: int
    accepted: int
    rejected: int
    crashes: int
    snapshots: int
    journal_records: int
    journal_digest: str
    state_digest: str
    failures: tuple[str, ...]


@attrs.frozen
class SimulationOptions:
    steps: int = 2000
    crash_probability: float = 0.002
    check_every: int = 50
    snapshot_every_records: int = 500
    workload: WorkloadOptions = attrs.Factory(WorkloadOptions)


async def simulate(seed: int, options: SimulationOptions) -> SimulationResult:
    faults = random.Random(f"{seed}:faults")
    journal = MemoryJournal()
    clock = TrioClock()
    failures: list[str] = []
    accepted = rejected = crashes = snapshots = 0
    states: dict[ScopeKey, ScopeState] = {}
    steps = iter(trace(seed, options.steps, options.workload))
    finished = False
    while not finished:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            system = ActorSystem(
                journal,
                clock,
                states,
                snapshot_every_records=options.snapshot_every_records,
                encode_snapshots_in_thread=False,
                seed=seed,
            )
            await nursery.start(system.run)
            for index, step in enumerate(steps):
                await trio.sleep(step.advance_seconds)
                command = attrs.evolve(step.command, at=clock.now_ns())
                decision = await system.ask(step.scope, command)
                accepted += isinstance(decision, Accepted)
                rejected += not isinstance(decision, Accepted)
                await trio.testing.wait_all_tasks_blocked()
                if index % options.check_every == 0:
                    failures.extend(invariant_failures(system.states()))
                if faults.random() < options.crash_probability:
                    crashes += 1
                    break
            else:
                finished = True
            snapshots += system.snapshots_taken
            live = system.states()
            nursery.cancel_scope.cancel()
        failures.extend(invariant_failures(live))
        mismatch = replay_mismatch(journal, live)
        if mismatch:
            failures.append(mismatch)
        # "Restart": a new process sees only what the journal holds.
        journal = journal.crash_copy()
        states = recover(journal).states
    return SimulationResult(
        seed,
        options.steps,
        accepted,
        rejected,
        crashes,
        snapshots,
        journal.last_lsn,
        journal_digest(journal),
        states_digest(list(states.values())),
        tuple(failures),
    )
