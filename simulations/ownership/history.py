"""The run's history: every client invocation and completion and every fault, one JSON line each.

Jepsen's vocabulary: ``invoke``, then ``ok`` (applied), ``fail`` (not applied: refused by the rules, or 503) or
``info`` (unknown: 504 or no answer in time). Lines are canonical JSON (sorted keys), so equal runs give equal
bytes and the SHA-256 printed for a seed identifies its history.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class History:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def to_bytes(self) -> bytes:
        return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in self.records)

    def digest(self) -> str:
        sha = hashlib.sha256()
        for record in self.records:
            sha.update(json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n")
        return sha.hexdigest()
