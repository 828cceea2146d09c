"""ScopeState: what one scope actor owns, as two parts with their own snapshots and invariants.

* ``slots`` (``SlotTracking``): registered DP ranges, ranks, active requests and their loads; the slot
  tracker's whole state, and where the selection service books its reservations.
* ``selection`` (``SelectionState``): the partition's catalog, KV index, KV-event watermarks,
  approximate-mode expiries and block size.

The selection service registers each catalog record's DP range in ``slots`` (that is where its ranks'
loads live); the slot tracker leaves ``selection`` empty. Not copied per event (a copy per event would
make large states unusable); determinism comes from single ownership and an ordered mailbox. Only
``evolve`` mutates it.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.selection_state import SelectionState
from kvrouter.actors.core.slots import ActiveRequest, RankState, SlotTracking

__all__ = ["ActiveRequest", "RankState", "ScopeState"]


class ScopeState:
    __slots__ = ("scope", "selection", "slots")

    def __init__(self, scope: ScopeKey) -> None:
        self.scope = scope
        self.slots = SlotTracking()
        self.selection = SelectionState()

    @property
    def exists(self) -> bool:
        """Whether the scope is kept (and its actor lives): a slot tracker while it has a worker, a
        selection partition once its block size is fixed (or while it has records or blocks)."""
        return bool(self.slots.workers) or self.selection.exists  # slots.exists, inlined: checked per command

    # -- views for the shell (the core reads the parts directly) ----------------------------------------

    @property
    def requests(self) -> dict[str, ActiveRequest]:
        return self.slots.requests

    @property
    def ranks(self) -> dict[WorkerRank, RankState]:
        return self.slots.ranks

    @property
    def catalog(self) -> dict[int, WorkerRecord]:
        return self.selection.catalog

    @property
    def kv_watermarks(self) -> dict[WorkerRank, int]:
        return self.selection.kv_watermarks

    @property
    def block_size(self) -> int | None:
        """The block size requests in this scope are counted in: the slot tracker's, else the partition's."""
        size = self.slots.block_size
        return size if size is not None else self.selection.partition_block_size

    # -- snapshot ---------------------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        """Plain, JSON-ready, canonical form (format version 4 of ``actors/persistence/snapshots.py``)."""
        return {
            "model_name": self.scope.model_name,
            "tenant_id": self.scope.tenant_id,
            "slots": self.slots.to_snapshot(),
            "selection": self.selection.to_snapshot(),
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> ScopeState:
        state = cls(ScopeKey(data["model_name"], data["tenant_id"]))
        state.slots = SlotTracking.from_snapshot(data["slots"])
        state.selection = SelectionState.from_snapshot(data["selection"])
        return state
