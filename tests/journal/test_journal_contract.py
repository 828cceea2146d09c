"""Run the shared journal contract against MemoryJournal and FileJournal (each durability mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from contract import JournalContract, StagedSnapshotContract

from kvrouter.journal.file import FileJournal
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.store import Durability, Journal, SnapshotStaging


class TestMemoryJournal(JournalContract):
    def make_journal(self) -> Journal:
        return MemoryJournal()

    async def restart(self, journal: Journal) -> Journal:
        assert isinstance(journal, MemoryJournal)
        return journal.crash_copy()  # a crash loses nothing that was durable, and all of it was

    def test_has_no_staging(self) -> None:
        # Simulations snapshot inline through write_snapshot: no file, no child process.
        assert not isinstance(MemoryJournal(), SnapshotStaging)


class TestFileJournal(StagedSnapshotContract):
    @pytest.fixture(autouse=True, params=list(Durability), ids=lambda d: d.value)
    def _config(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.durability: Durability = request.param
        self.path = tmp_path / "journal"

    def make_journal(self) -> Journal:
        return FileJournal.open(self.path, self.durability)

    async def restart(self, journal: Journal) -> Journal:
        await journal.aclose()
        return FileJournal.open(self.path, self.durability)
