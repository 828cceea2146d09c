"""Wait until trio's event loop has nothing runnable: the journal gathers a group commit there, and the shell
starts background work there (``actors/loop_idle.py``).

trio's idle detector is public only in ``trio.testing``, which imports pytest when pytest is installed
(~90 ms at every start where the test extra is installed). It is imported at the first wait instead, so a
service reaches ready without it; the first group commit pays the import once.
"""

from __future__ import annotations


async def wait_until_loop_idle() -> None:
    """Return once no other task is runnable and no I/O is ready (cancel it to bound the wait)."""
    from trio.testing import wait_all_tasks_blocked

    await wait_all_tasks_blocked()
