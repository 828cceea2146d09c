"""What the in-task turn saves KV ingest: CPU per run through ``ActorSystem.apply_kv`` when an idle actor's turn
runs in the caller's task (``ScopeActor.apply_now``, what the service does), and when every run is handed to the
actor's task through the mailbox instead. In-process, one scope, a memory journal; CPU time (not wall time), the
two variants alternated round by round so a busy machine moves them alike.

    .venv/bin/python benchmarks/kv_door_bench.py [--runs 20000] [--blocks 1] [--rounds 3]

``--blocks``: blocks per run (a listener's runs hold up to 1,024; the saving is per run, so small runs show it).
"""

from __future__ import annotations

import argparse
import time

import trio

from kvrouter.actors.actor import ScopeActor
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import IngestKvBatch, UpsertWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("bench", "default")
BLOCK = 16
# Schedulable with KV events (nothing listens on the endpoint: the runs are handed over here).
WORKER = WorkerRecord(
    1,
    SCOPE.model_name,
    SCOPE.tenant_id,
    endpoint="http://w",
    kv_events_endpoint="tcp://127.0.0.1:5557",
    block_size=BLOCK,
)


def runs(count: int, blocks: int) -> list[IngestKvBatch]:
    """``count`` runs of one batch storing ``blocks`` new blocks each (a chain growing run by run)."""
    made = []
    for seq in range(count):
        hashes = tuple(range(seq * blocks + 1, (seq + 1) * blocks + 1))
        parent = seq * blocks if seq else None
        tokens = tuple(range(seq * blocks * BLOCK, (seq + 1) * blocks * BLOCK))
        made.append(IngestKvBatch(1, 0, seq, KvBatch(0.0, (BlockStored(hashes, parent, tokens, BLOCK),))))
    return made


async def cpu_per_run(commands: list[IngestKvBatch], blocks: int, in_task: bool) -> float:
    """Microseconds of this process's CPU per run, applying ``commands`` one after another."""
    journal = MemoryJournal()
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False, snapshot_every_records=10**9)
    apply_now = ScopeActor.apply_now
    if not in_task:
        ScopeActor.apply_now = lambda actor, envelope: False  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(system.run)
            await system.ask(SCOPE, UpsertWorker(WORKER))
            started = time.process_time()
            for command in commands:
                await system.apply_kv(SCOPE, command, blocks)
            spent = time.process_time() - started
            nursery.cancel_scope.cancel()
    finally:
        ScopeActor.apply_now = apply_now  # type: ignore[method-assign]
    state = system.state(SCOPE)
    assert state is not None and state.selection.index.block_count() == len(commands) * blocks
    return 1e6 * spent / len(commands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=1, help="blocks per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    commands = runs(args.runs, args.blocks)
    figures: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for in_task in order:
            figures[in_task].append(trio.run(cpu_per_run, commands, args.blocks, in_task))
    for in_task, label in ((True, "in-task turn (the service)"), (False, "every run through the mailbox")):
        values = sorted(figures[in_task])
        shown = ", ".join(f"{v:.1f}" for v in figures[in_task])
        print(f"{label:32} {values[len(values) // 2]:7.1f} us CPU per run (rounds: {shown})")


if __name__ == "__main__":
    main()
