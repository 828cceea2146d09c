"""Small value types shared by the core, the shell and the wire.

Hashes are kept as unsigned 64-bit ints inside kvrouter; the HTTP API speaks signed 64-bit JSON
integers (as the reference does) and converts bit for bit at the boundary.
"""

from __future__ import annotations

from typing import NamedTuple

U64_MASK = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1


class ScopeKey(NamedTuple):
    """One (model, tenant) partition: its own workers, requests, block size and actor."""

    model_name: str
    tenant_id: str

    def describe(self) -> str:
        return f"model={self.model_name} tenant_id={self.tenant_id}"


class WorkerRank(NamedTuple):
    """The unit of load accounting: one data-parallel rank of one worker."""

    worker_id: int
    dp_rank: int


def to_u64(value: int) -> int:
    """Reinterpret a signed 64-bit hash as unsigned (``-1`` becomes ``2**64 - 1``)."""
    return value & U64_MASK


def to_i64(value: int) -> int:
    """Reinterpret an unsigned 64-bit hash as signed, for JSON responses."""
    return value - (1 << 64) if value > I64_MAX else value
