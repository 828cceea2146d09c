"""Fenced snapshot writes in the JetStream object store: a snapshot replaces the stored one only if it is newer.

An object of a JetStream object store is chunks on a subject of their own (``$O.<bucket>.C.<nuid>``) and one meta
message (``$O.<bucket>.M.<name in base64>``, JSON) naming them; the meta subject keeps only its last message (a
rollup). nats-py's ``put`` replaces the meta unconditionally, so a stale owner could replace a newer snapshot with
an older one whose tail the newer one's owner had already purged. Here the meta is published the way a journal
append is: fenced on the meta subject's last sequence as read (``Nats-Expected-Last-Subject-Sequence``) just before
comparing. So the meta a snapshot replaces is exactly the one it was found newer than; if another writer replaced it
meanwhile, JetStream refuses the publish and the comparison is made again against the new one.

What is stored stays readable by nats-py and the NATS tools (the same chunks and meta JSON). The meta's headers carry
the lsn the snapshot covers and the stream sequence its replay starts from (``Kvr-Snapshot-Lsn``,
``Kvr-Replay-From``, version ``Kvr-Snapshot: 1``), so the comparison reads a few hundred bytes, not the object. A
meta without them (written by an earlier kvrouter, with ``put``) is read as it was written: the lsn is the first 8
bytes of the object's data, read from its first chunk (the upcast).

Runs on the journal's asyncio thread, as ``jetstream_link``; every call bounded by the caller's timeouts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from datetime import UTC, datetime
from typing import Any, Final

import attrs
import nats.js.errors
from nats.js import api as js_api
from nats.nuid import NUID

log = logging.getLogger("kvrouter.journal")

CHUNK_BYTES: Final = 128 * 1024  # nats-py's default chunk size for the object store
VERSION_HEADER: Final = "Kvr-Snapshot"
VERSION: Final = "1"
LSN_HEADER: Final = "Kvr-Snapshot-Lsn"
REPLAY_HEADER: Final = "Kvr-Replay-From"
FENCE_HEADER: Final = "Nats-Expected-Last-Subject-Sequence"
ROLLUP_HEADER: Final = "Nats-Rollup"
WRONG_LAST_SEQUENCE: Final = 10071  # JetStream's error code for a failed Nats-Expected-Last-Subject-Sequence
ATTEMPTS: Final = 8  # fenced publishes refused because another writer replaced the meta meanwhile, before giving up
LSN_BYTES: Final = 8  # the snapshot data's first field (``jetstream_link.SNAPSHOT_HEADER``): the lsn it covers


class SnapshotRaced(Exception):
    """Other writers replaced the snapshot ``ATTEMPTS`` times while this one was being written."""


@attrs.frozen
class StoredMeta:
    """The meta subject's last message as read: its sequence (0: none; the fence), the lsn the stored snapshot
    covers (-1: none, or deleted) and the nuid of its chunks (empty: none)."""

    seq: int
    lsn: int
    nuid: str


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def stream_of(bucket: str) -> str:
    return f"OBJ_{bucket}"


async def stored_meta(js: Any, bucket: str, name: str) -> StoredMeta:
    """The stored snapshot's meta: its sequence, the lsn it covers, its chunks."""
    try:
        message = await js.get_last_msg(stream_of(bucket), meta_subject(bucket, name))
    except nats.js.errors.NotFoundError:
        return StoredMeta(0, -1, "")
    info = json.loads(message.data)
    if info.get("deleted"):
        return StoredMeta(int(message.seq), -1, "")
    nuid = str(info.get("nuid", ""))
    headers = info.get("headers") or {}
    covered = headers.get(LSN_HEADER)
    if covered:
        return StoredMeta(int(message.seq), int(covered[0]), nuid)
    return StoredMeta(int(message.seq), await _lsn_from_data(js, bucket, nuid), nuid)  # an earlier build's


async def _lsn_from_data(js: Any, bucket: str, nuid: str) -> int:
    """The upcast: a snapshot stored without the lsn header covers the lsn its data starts with."""
    try:
        first = await js.get_msg(stream_of(bucket), subject=chunk_subject(bucket, nuid), next=True, seq=1)
    except nats.js.errors.NotFoundError:
        return -1  # no chunks: no snapshot to keep
    data: bytes = first.data or b""
    return int.from_bytes(data[:LSN_BYTES], "big") if len(data) >= LSN_BYTES else -1


async def put_if_newer(js: Any, bucket: str, name: str, data: bytes, lsn: int, replay_from: int) -> bool:
    """Store ``data`` (a snapshot covering ``lsn``) as object ``name`` only if the stored one covers less; False
    (nothing changed) if it covers as much or more. ``SnapshotRaced`` if other writers kept replacing it."""
    for _ in range(ATTEMPTS):
        stored = await stored_meta(js, bucket, name)
        if stored.lsn >= lsn:
            log.warning(
                "snapshot %s not stored: the stored one covers lsn %d, this one only %d (a newer owner wrote it)",
                name,
                stored.lsn,
                lsn,
            )
            return False
        nuid = NUID().next().decode()
        info = await _put_chunks(js, bucket, name, nuid, data)
        info.headers = {VERSION_HEADER: [VERSION], LSN_HEADER: [str(lsn)], REPLAY_HEADER: [str(replay_from)]}
        headers = {ROLLUP_HEADER: "sub", FENCE_HEADER: str(stored.seq)}
        try:
            await js.publish(meta_subject(bucket, name), json.dumps(info.as_dict()).encode(), headers=headers)
        except nats.js.errors.APIError as exc:
            await js.purge_stream(stream_of(bucket), subject=chunk_subject(bucket, nuid))
            if exc.err_code == WRONG_LAST_SEQUENCE:
                continue  # another writer replaced the meta since it was read: compare with theirs
            raise
        except Exception:
            await js.purge_stream(stream_of(bucket), subject=chunk_subject(bucket, nuid))
            raise
        if stored.nuid:
            await js.purge_stream(stream_of(bucket), subject=chunk_subject(bucket, stored.nuid))
        return True
    raise SnapshotRaced(f"the snapshot {name} was replaced by other writers {ATTEMPTS} times while this one was stored")


async def _put_chunks(js: Any, bucket: str, name: str, nuid: str, data: bytes) -> js_api.ObjectInfo:
    """Publish ``data`` as the chunks of a new object version; its meta, not yet published."""
    subject = chunk_subject(bucket, nuid)
    chunks = 0
    try:
        for start in range(0, len(data), CHUNK_BYTES):
            await js.publish(subject, data[start : start + CHUNK_BYTES])
            chunks += 1
    except Exception:
        await js.purge_stream(stream_of(bucket), subject=subject)
        raise
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    return js_api.ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=len(data),
        chunks=chunks,
        digest=f"SHA-256={digest}",
        mtime=datetime.now(UTC).isoformat(),
        options=js_api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
    )
