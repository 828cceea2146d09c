"""Invariant checks shared by tests, simulations and debug assertions. Pure; returns messages.

Each part checks itself (``SlotTracking.check``, ``SelectionState.check``, which runs the KV index's
``KvIndex.check``); this module adds what ties the parts together.
"""

from __future__ import annotations

from kvrouter.actors.core.state import ScopeState


def check(state: ScopeState) -> list[str]:
    slots, selection = state.slots, state.selection
    problems = slots.check()
    problems.extend(selection.check())
    catalog = selection.catalog
    for worker_id, (start, size) in slots.workers.items():
        record = catalog.get(worker_id)
        if record is None:
            if slots.block_size is None:
                problems.append(f"worker {worker_id}: registered range without a block size or a catalog record")
        elif (record.dp_start, record.dp_size) != (start, size):
            problems.append(f"worker {worker_id}: registered range {(start, size)} is not its record's")
    for worker_id, record in catalog.items():
        if record.scope != state.scope:
            problems.append(f"worker {worker_id}: catalog record names {record.scope.describe()}")
        if record.dp_size > 0 and worker_id not in slots.workers:
            problems.append(f"worker {worker_id}: catalog record's ranks are not registered")
    for name, per_rank in (("KV-event watermark", selection.kv_watermarks), ("expiry", selection.approx_expiry)):
        for rank in per_rank:
            if rank not in slots.ranks:
                problems.append(f"{rank}: {name} kept for a rank that is not registered")
    return problems
