"""``when_loop_idle``: background work waits while any other task is runnable, at most its bound."""

from __future__ import annotations

import trio
import trio.testing

from kvrouter.actors import loop_idle
from kvrouter.actors.loop_idle import when_loop_idle
from kvrouter.journal import loop_idle as journal_loop_idle


def test_the_idle_detector_is_the_journals_lazy_one() -> None:
    """One idle wait for the shell and the journal (``journal/loop_idle.py``: trio.testing's detector, imported
    at the first wait); the journal's tests check that it is trio's."""
    assert loop_idle._wait_until_loop_idle is journal_loop_idle.wait_until_loop_idle


async def test_it_waits_while_another_task_is_runnable_and_no_longer(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    went = trio.Event()

    async def background() -> None:
        await when_loop_idle(1.0)
        went.set()

    nursery.start_soon(background)
    for _ in range(100):  # a request's steps
        await trio.lowlevel.checkpoint()
    assert not went.is_set()
    mock_clock.autojump_threshold = 0.1  # (real seconds) if it did not go at the first idle moment, its bound passes
    await went.wait()  # the request waits for something: nothing else is runnable
    assert trio.current_time() < 1.0  # it went because the loop idled, not because its bound passed


async def test_a_loop_that_never_idles_lets_it_go_after_its_bound(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    went = trio.Event()

    async def background(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await when_loop_idle(1.0)  # (entered in the same step: its bound runs from now)
        went.set()

    await nursery.start(background)
    mock_clock.jump(0.5)
    for _ in range(10):  # a request's steps, for half the bound
        await trio.lowlevel.checkpoint()
    assert not went.is_set()
    mock_clock.jump(0.5)
    for _ in range(10):
        await trio.lowlevel.checkpoint()
    assert went.is_set()
