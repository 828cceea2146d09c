"""Writing journal records straight into a data directory, as an older build (or a bug) would have."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio

from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import Durability


async def append_records(data_dir: Path, payloads: list[bytes]) -> None:
    """Append ``payloads`` (encoded records) to the journal in ``data_dir``; no service may hold it."""
    journal = await trio.to_thread.run_sync(partial(FileJournal.open, data_dir, Durability.ALWAYS))
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for payload in payloads:
            journal.append(payload)
        await journal.aclose()
