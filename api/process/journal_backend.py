"""Which journal a service writes: the file journal in its data directory (the default), or a JetStream stream
(``--journal jetstream``), so that the log outlives the machine (``docs/operations/cluster.md``).

One place opens either, so the composition root (``api/process/main.py``) and the CLI (``api/cli/settings.py``)
name the backend once; the data directory stays in use either way (its lock and owner marker).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import Durability

if TYPE_CHECKING:  # imported when opened: it loads the NATS client (~40 ms at every start)
    from kvrouter.journal.jetstream import JetStreamJournal  # here, not at the top: see TYPE_CHECKING above

JOURNAL_BACKENDS: Final = ("file", "jetstream")
STREAM_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_JETSTREAM_REPLICAS: Final = 5  # JetStream's own bound on a stream's replicas


@attrs.frozen
class JetStreamJournalOptions:
    servers: tuple[str, ...]  # NATS URLs (--nats-server, NATS_SERVER)
    stream: str  # the JetStream stream (--jetstream-stream)
    replicas: int = 1  # the stream's replica count (--jetstream-replicas)

    def describe(self) -> str:
        return f"JetStream stream {self.stream} (R={self.replicas}) on {','.join(self.servers)}"


def default_stream(service: str) -> str:
    """``slot tracker`` -> ``KVROUTER_SLOT_TRACKER``: a stream name per service when none is given."""
    return "KVROUTER_" + re.sub(r"[^A-Za-z0-9]+", "_", service).upper()


def stream_problem(stream: str) -> str | None:
    if STREAM_NAME.fullmatch(stream):
        return None
    return f"--jetstream-stream={stream!r} must be 1-64 letters, digits, '_' or '-'"


def open_journal(
    data_dir: Path, durability: Durability, jetstream: JetStreamJournalOptions | None, *, fresh: bool
) -> FileJournal | JetStreamJournal:
    """The service's journal, opened and scanned (blocking: run it in a thread). ``JournalUnreachable`` when
    the JetStream journal's server does not answer."""
    if jetstream is None:
        return FileJournal.open(data_dir, durability, fresh=fresh)
    from kvrouter.journal.jetstream import JetStreamJournal  # here, not at the top: see TYPE_CHECKING above

    return JetStreamJournal.open(
        jetstream.servers, jetstream.stream, durability, fresh=fresh, replicas=jetstream.replicas
    )
