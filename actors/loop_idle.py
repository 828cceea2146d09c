"""Background work that goes after the requests: it starts when the event loop has nothing else to run.

Trio has no task priorities: every runnable task gets one step per scheduling round, and a request needs
several rounds, so a request waits for all the background work that runs in its rounds. A KV-event flood is
such work (a run of 1,024 blocks is ~0.3-0.5 ms of decoding and ~0.5-1 ms of applying, compiled). Work that
awaits ``when_loop_idle`` before each piece starts it only once no task is runnable and no socket is ready: a
request then waits for at most the piece already running when it arrived, never for the next ones.

One idle moment wakes EVERY task waiting for it (trio wakes all ``wait_all_tasks_blocked`` waiters of the same
cushion together): pieces from several tasks would start in the same round and a request would wait for all of
them. So work split across tasks takes turns at one piece at a time (KV ingest: ``KvIngest.pieces``, a lock).

Policy when the loop never idles (requests back to back): the background work starts anyway after
``at_most`` seconds of waiting, so it is slowed, never starved (a piece of work per ``at_most`` at least).
"""

from __future__ import annotations

import trio

from kvrouter.journal.loop_idle import wait_until_loop_idle as _wait_until_loop_idle


async def when_loop_idle(at_most: float) -> None:
    """Return once no other task is runnable and no I/O is ready, or after ``at_most`` seconds."""
    with trio.move_on_after(at_most):
        await _wait_until_loop_idle()
