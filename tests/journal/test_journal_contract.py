"""Run the shared journal contract against MemoryJournal and FileJournal (each durability mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from contract import JournalContract

from kvrouter.journal.file import FileJournal
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.store import Durability, Journal


class TestMemoryJournal(JournalContract):
    def make_journal(self) -> Journal:
        return MemoryJournal()

    async def restart(self, journal: Journal) -> Journal:
        assert isinstance(journal, MemoryJournal)
        return journal.crash_copy()  # a crash loses nothing that was durable, and all of it was


class TestFileJournal(JournalContract):
    @pytest.fixture(autouse=True, params=list(Durability), ids=lambda d: d.value)
    def _config(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.durability: Durability = request.param
        self.path = tmp_path / "journal"

    def make_journal(self) -> Journal:
        return FileJournal.open(self.path, self.durability)

    async def restart(self, journal: Journal) -> Journal:
        await journal.aclose()
        return FileJournal.open(self.path, self.durability)
