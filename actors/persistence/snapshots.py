"""Snapshots: every scope's state as one versioned document, and read back from older versions.

A snapshot payload is JSON::

    {"v": 2, "lsn": lsn, "state_hash": sha256 of the canonical scopes, "scopes": [ScopeState.to_snapshot(), ...]}

Versions: 1 stored each scope flat (one shared ``block_size``, output blocks as ``[count, weight]``); 2 stores
each scope as its two parts, ``{"model_name", "tenant_id", "slots": {...}, "selection": {...}}``, with output
blocks as ``[decayed, weight, whole]`` (see ``actors/core/slots.py``); 3 keeps predicted (booked) blocks in their
own index (``selection.predicted``, out of ``selection.index``) and adds ``selection.sessions``; 4 adds each
catalog record's ``worker_role`` and each request row's ``expected_output_tokens``.

To change the layout (as v2 did, splitting each scope in two): bump ``SNAPSHOT_VERSION`` to N+1 and write ONE
function that turns a version-N document into an N+1 document, registered for its version::

    @snapshot_upcaster(from_version=N)
    def _scopes_vN_to_vN1(document: dict[str, Any]) -> dict[str, Any]:
        document["scopes"] = [split(scope) for scope in document["scopes"]]
        return document

then add the new golden snapshot (``python tests/persistence/make_goldens.py``). The upcaster only
rewrites the document's ``scopes`` (and whatever else changed); ``v`` is advanced for it, and the
state hash is checked against the bytes as stored, before any upcaster ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import orjson

from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_index import KvIndex, Tier
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import digest
from kvrouter.journal.store import CorruptJournal

SNAPSHOT_VERSION: Final = 5

SnapshotUpcaster = Callable[[dict[str, Any]], dict[str, Any]]
# version it reads -> a function turning that version's document into the next version's.
SNAPSHOT_UPCASTERS: dict[int, SnapshotUpcaster] = {}

_RESTORE_HINT: Final = (
    "start with --fresh to discard the data directory, or restore it from a backup "
    "(if a newer kvrouter wrote it, run that one instead)"
)


def snapshot_upcaster(*, from_version: int) -> Callable[[SnapshotUpcaster], SnapshotUpcaster]:
    """Register ``fn`` as the step from snapshot version ``from_version`` to ``from_version + 1``."""

    def register(fn: SnapshotUpcaster) -> SnapshotUpcaster:
        if not 1 <= from_version < SNAPSHOT_VERSION:
            raise ValueError(f"a snapshot upcaster must read a version in 1..{SNAPSHOT_VERSION - 1}")
        if from_version in SNAPSHOT_UPCASTERS:
            raise ValueError(f"two snapshot upcasters from version {from_version}")
        SNAPSHOT_UPCASTERS[from_version] = fn
        return fn

    return register


class UnreadableSnapshot(CorruptJournal):
    """A snapshot whose checksum is fine but whose content does not restore."""

    def __init__(self, lsn: int | None, problem: str) -> None:
        self.lsn = lsn
        self.problem = problem
        where = f"at lsn {lsn}" if lsn is not None else "(lsn unknown)"
        super().__init__(f"snapshot {where} cannot be restored: {problem}; {_RESTORE_HINT}")


def encode_snapshot(lsn: int, scopes: list[dict[str, Any]]) -> bytes:
    """``scopes`` are ``ScopeState.to_snapshot()`` copies, sorted by scope."""
    return orjson.dumps({"v": SNAPSHOT_VERSION, "lsn": lsn, "state_hash": digest(scopes), "scopes": scopes})


def restore_snapshot(payload: bytes) -> dict[ScopeKey, ScopeState]:
    """The states a snapshot payload of any version up to ``SNAPSHOT_VERSION`` holds.

    Restoring must reproduce the recorded state hash, which catches drift between ``to_snapshot`` and
    ``from_snapshot`` before the service serves a single request.
    """
    document = _load(payload)
    lsn = document.get("lsn")
    expected_hash = document.get("state_hash")
    if document["v"] != SNAPSHOT_VERSION:
        if digest(document["scopes"]) != expected_hash:
            raise UnreadableSnapshot(lsn, "its scopes do not match its recorded state hash")
        try:
            document = upcast_snapshot(document)
        except UnreadableSnapshot:
            raise
        except Exception as exc:
            raise UnreadableSnapshot(lsn, f"an upcaster failed ({type(exc).__name__}: {exc})") from exc
        expected_hash = digest(document["scopes"])  # what restoring the upcast scopes must reproduce
    try:
        states = {}
        for data in document["scopes"]:
            state = ScopeState.from_snapshot(data)
            states[state.scope] = state
    except Exception as exc:
        raise UnreadableSnapshot(lsn, f"a scope does not restore ({type(exc).__name__}: {exc})") from exc
    restored = digest([s.to_snapshot() for s in sorted(states.values(), key=lambda s: s.scope)])
    if restored != expected_hash:
        raise UnreadableSnapshot(lsn, "it does not restore to its recorded state hash")
    return states


def upcast_snapshot(document: dict[str, Any]) -> dict[str, Any]:
    """Bring a snapshot document to ``SNAPSHOT_VERSION`` through every upcaster from its version."""
    version = document["v"]
    while version < SNAPSHOT_VERSION:
        upcaster = SNAPSHOT_UPCASTERS.get(version)
        if upcaster is None:
            raise UnreadableSnapshot(document.get("lsn"), f"no upcaster reads snapshot format version {version}")
        document = upcaster(document)
        version += 1
        document["v"] = version
    return document


@snapshot_upcaster(from_version=1)
def _scopes_v1_to_v2(document: dict[str, Any]) -> dict[str, Any]:
    document["scopes"] = [_split_scope_v1(scope) for scope in document["scopes"]]
    return document


def _split_scope_v1(scope: dict[str, Any]) -> dict[str, Any]:
    """One v1 scope as its two parts. v1's single ``block_size`` was the slot tracker's when a registered
    worker has no catalog record, and the selection partition's when the scope has a catalog or blocks.
    A v1 output count shared the latest weight: ``decayed`` blocks of that weight in v2 (``whole`` ones at 1.0)."""
    catalog = scope["catalog"]
    in_catalog = {plain["worker_id"] for plain in catalog}
    tracker = any(worker_id not in in_catalog for worker_id, _, _ in scope["workers"])
    partition = bool(catalog) or bool(scope["index"]["ranks"])
    requests = [[*request[:6], _outputs_v1_to_v2(*request[6])] for request in scope["requests"]]
    return {
        "model_name": scope["model_name"],
        "tenant_id": scope["tenant_id"],
        "slots": {
            "block_size": scope["block_size"] if tracker else None,
            "workers": scope["workers"],
            "requests": requests,
            "fractions": scope["fractions"],
        },
        "selection": {
            "partition_block_size": scope["block_size"] if partition else None,
            "catalog": catalog,
            "index": scope["index"],
            "kv_watermarks": scope["kv_watermarks"],
            "approx_expiry": scope["approx_expiry"],
        },
    }


@snapshot_upcaster(from_version=2)
def _scopes_v2_to_v3(document: dict[str, Any]) -> dict[str, Any]:
    for scope in document["scopes"]:
        _split_predicted_v2(scope["selection"])
    return document


def _split_predicted_v2(selection: dict[str, Any]) -> None:
    """v2 kept booked blocks in the one index: move each rank's runs made only of booked blocks (those with an
    expiry, chained from the root or from a booked block) to the predicted index. No sessions existed."""
    index = KvIndex.from_snapshot(selection["index"])
    predicted = KvIndex()
    booked = {WorkerRank(w, r): {h for h, _ in items} for w, r, items in selection["approx_expiry"]}
    moved = []
    for run in index.dump_events():
        hashes = booked.get(run.rank)
        if run.tier is not Tier.DEVICE or hashes is None:
            continue
        if all(ext in hashes for ext, _ in run.blocks) and (run.parent_hash is None or run.parent_hash in hashes):
            predicted.apply_stored(run.rank, Tier.DEVICE, run.parent_hash, run.blocks)
            moved.append(run)
    for run in moved:
        index.apply_removed(run.rank, Tier.DEVICE, (run.blocks[0][0],))
    selection["index"] = index.to_snapshot()
    selection["predicted"] = predicted.to_snapshot()
    selection["sessions"] = []


def _outputs_v1_to_v2(count: int, weight: float) -> list[Any]:
    return [0, 1.0, count] if weight == 1.0 else [count, weight, 0]


@snapshot_upcaster(from_version=3)
def _scopes_v3_to_v4(document: dict[str, Any]) -> dict[str, Any]:
    """v4: catalog records have a ``worker_role`` and request rows end with ``expected_output_tokens`` (none
    before: a role-less worker is "both", and a booking without the figure decays only as the client says)."""
    for scope in document["scopes"]:
        for record in scope["selection"]["catalog"]:
            record["worker_role"] = None
        scope["slots"]["requests"] = [[*row, None] for row in scope["slots"]["requests"]]
    return document


@snapshot_upcaster(from_version=4)
def _scopes_v4_to_v5(document: dict[str, Any]) -> dict[str, Any]:
    """v5: catalog records name the discovery source that owns them (none before: all registered over HTTP)."""
    for scope in document["scopes"]:
        for record in scope["selection"]["catalog"]:
            record["discovered_by"] = None
    return document


def _load(payload: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UnreadableSnapshot(None, f"not JSON ({exc})") from exc
    if type(document) is not dict or not {"v", "scopes", "state_hash"} <= document.keys():
        raise UnreadableSnapshot(None, 'not a snapshot document (it needs "v", "state_hash" and "scopes")')
    version = document["v"]
    if type(version) is not int or version < 1:
        raise UnreadableSnapshot(document.get("lsn"), f"invalid snapshot format version {version!r}")
    if version > SNAPSHOT_VERSION:
        raise UnreadableSnapshot(
            document.get("lsn"),
            f"snapshot format version {version} is newer than this build reads ({SNAPSHOT_VERSION})",
        )
    return document
