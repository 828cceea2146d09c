"""The asyncio side of the JetStream journal: every nats-py call it makes, each bounded by a timeout of its own.

Everything here runs on the journal's asyncio thread (``journal/asyncio_thread``); the trio side
(``journal/jetstream``) crosses to it once per group commit (``publish``), once per snapshot, once per chunk of a
read, never once per record. nats-py swallows cancellation in places, so nothing here relies on being cancelled:
each call is bounded on this side (``asyncio.wait_for`` or nats-py's own ``timeout``), and a call that runs out of
time raises like any failure.

The layout on the server (``docs/operations/cluster.md``): the stream ``NAME`` captures ``kvrouter.journal.NAME.>``;
a journal is one log in it, named by a token (``log`` for a service's one journal): its records go to
``kvrouter.journal.NAME.<log>`` and its snapshot to the object store bucket ``NAME_snapshots`` under the object
name ``latest`` (the service's journal) or ``<log>`` (any other log: a cluster keeps one per scope).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
from collections.abc import Iterable
from typing import Any, Final

import attrs
import nats
import nats.errors
import nats.js.errors
from nats.js import api as js_api

from kvrouter.journal import jetstream_batch as batch
from kvrouter.journal import jetstream_snapshots as snapshots
from kvrouter.journal.store import JournalFenced, JournalUnreachable, JournalWriteFailed, Snapshot

log = logging.getLogger("kvrouter.journal")

CONNECT_TIMEOUT_SECONDS: Final = 2.0  # per server, at startup
REQUEST_TIMEOUT_SECONDS: Final = 5.0  # one publish, one stream request, one object store call
FETCH_WAIT_SECONDS: Final = 1.0  # one pull of a read chunk
READ_CHUNK_MESSAGES: Final = 64  # messages per read crossing (each at most max_payload bytes)
SNAPSHOT_OBJECT: Final = "latest"
SNAPSHOT_HEADER: Final = struct.Struct(">QQ")  # snapshot lsn, stream sequence its replay starts from
WRONG_LAST_SEQUENCE: Final = 10071  # JetStream's error code for a failed Nats-Expected-Last-Subject-Sequence


DEFAULT_LOG: Final = "log"  # the one journal of a service
LOG_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]{1,1024}")  # a subject token: no dot, space or wildcard


def subject_of(stream: str, log: str = DEFAULT_LOG) -> str:
    return f"kvrouter.journal.{stream}.{log}"


def check_log(log: str) -> None:
    if not LOG_TOKEN.fullmatch(log):
        raise ValueError(f"a journal's log name must be a subject token (letters, digits, '_', '-'), not {log!r}")


def snapshot_object_of(log: str) -> str:
    return SNAPSHOT_OBJECT if log == DEFAULT_LOG else log


def subjects_of(stream: str) -> str:
    return f"kvrouter.journal.{stream}.>"


def bucket_of(stream: str) -> str:
    return f"{stream}_snapshots"


@attrs.frozen
class StoredSnapshot:
    snapshot: Snapshot
    replay_from: int  # the stream sequence of the first message that may hold records after the snapshot (0: none)


@attrs.frozen
class TailMessage:
    seq: int  # stream sequence
    first_lsn: int
    sizes: tuple[int, ...]  # payload sizes of its records


@attrs.frozen
class Fetched:
    """One message of the subject as read: where it sits, the message it follows on the chain, its body."""

    seq: int
    first_lsn: int
    prev: int
    body: bytes


@attrs.frozen
class Tail:
    """What startup needs of the log: the snapshot, and the messages of the chain after it (sizes only)."""

    snapshot: StoredSnapshot | None
    messages: tuple[TailMessage, ...]
    last_seq: int  # the subject's last stream sequence (0: empty): the first append's fence
    chain_seq: int = 0  # the chain's last message (the first append's ``Kvr-Prev``); last_seq unless it is off it
    off_chain: int = 0  # messages passed over (off the chain)


MAX_TAIL_ATTEMPTS: Final = 5  # reads of snapshot and tail, while a newer snapshot purges under the read


async def _ignore_error(exc: Exception) -> None:
    log.debug("nats (journal): %s", exc)


async def open_nats(servers: tuple[str, ...], name: str) -> Any:
    """A NATS connection, waited for at most ``CONNECT_TIMEOUT_SECONDS`` per server (TimeoutError past it); once
    open it reconnects for ever, quietly (the journal and the cluster's subject check say what failed)."""
    return await asyncio.wait_for(
        nats.connect(
            list(servers),
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
            error_cb=_ignore_error,
        ),
        CONNECT_TIMEOUT_SECONDS * len(servers) + 1,
    )


class JetStreamLink:
    """One connection and what the journal asks of it. Asyncio side only."""

    def __init__(self, nc: Any, stream: str, log: str = DEFAULT_LOG, replicas: int | None = None) -> None:
        check_log(log)
        self._nc = nc
        self._replicas = replicas  # the stream's replica count: created with it, refused if it differs; None: any
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_SECONDS)
        self.stream = stream
        self.subject = subject_of(stream, log)
        self._snapshot_object = snapshot_object_of(log)
        self._objects: Any = None

    @classmethod
    async def connect(
        cls, servers: tuple[str, ...], stream: str, log: str = DEFAULT_LOG, replicas: int | None = None
    ) -> JetStreamLink:
        """Connect (bounded) or raise ``JournalUnreachable`` naming the servers."""
        where = ",".join(servers)
        try:
            nc = await open_nats(servers, "kvrouter-journal")
        except TimeoutError:
            raise JournalUnreachable(
                f"cannot reach NATS at {where} for the JetStream journal (no connection within "
                f"{CONNECT_TIMEOUT_SECONDS * len(servers) + 1:g} s); start nats-server with -js or fix --nats-server"
            ) from None
        except (OSError, nats.errors.Error) as exc:
            raise JournalUnreachable(f"cannot reach NATS at {where} for the JetStream journal ({_why(exc)})") from None
        return cls(nc, stream, log, replicas)

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    async def prepare(self, fresh: bool) -> Tail:
        """The stream and the snapshot bucket (created if missing); with ``fresh``, emptied; then the tail."""
        try:
            await self._ensure_stream()
            self._objects = await self._ensure_bucket()
            if fresh:
                await self._js.purge_stream(self.stream, subject=self.subject)
                await self._delete_snapshot()
            return await self._tail()
        except (TimeoutError, nats.errors.Error) as exc:
            raise self._unserved(exc) from None

    async def ensure(self) -> None:
        """The stream and the snapshot bucket, created if missing (``JournalUnreachable`` if JetStream refuses)."""
        try:
            await self._ensure_stream()
            self._objects = await self._ensure_bucket()
        except (TimeoutError, nats.errors.Error) as exc:
            raise self._unserved(exc) from None

    def _unserved(self, exc: BaseException) -> JournalUnreachable:
        return JournalUnreachable(
            f"JetStream at {self._nc.connected_url.netloc if self._nc.connected_url else '?'} did not serve the "
            f"journal stream {self.stream} ({_why(exc)}); is JetStream enabled (nats-server -js)?"
        )

    async def _ensure_stream(self) -> None:
        wanted = subjects_of(self.stream)
        try:
            info = await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            await self._js.add_stream(
                name=self.stream,
                subjects=[wanted],
                storage=js_api.StorageType.FILE,
                num_replicas=self._replicas or 1,
            )
            return
        if wanted not in (info.config.subjects or []):
            raise JournalUnreachable(
                f"the JetStream stream {self.stream} exists but does not capture {wanted}; "
                "give --jetstream-stream a name of its own"
            )
        has = info.config.num_replicas or 1
        if self._replicas is not None and has != self._replicas:
            raise JournalUnreachable(
                f"the JetStream stream {self.stream} exists with {has} replica(s), not the {self._replicas} of "
                f"--jetstream-replicas; give that count, or change the stream's (nats stream edit) first"
            )

    async def _ensure_bucket(self) -> Any:
        """The snapshot bucket, with the stream's replica count: a snapshot on fewer servers than the records it
        replaces could be lost while they are purged (a recovery would then start from an older snapshot)."""
        bucket = bucket_of(self.stream)
        try:
            objects = await self._js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = js_api.ObjectStoreConfig(bucket=bucket, replicas=self._replicas or 1)
            return await self._js.create_object_store(bucket, config=config)
        if self._replicas is not None:
            info = await self._js.stream_info(f"OBJ_{bucket}")
            has = info.config.num_replicas or 1
            if has != self._replicas:
                raise JournalUnreachable(
                    f"the snapshot bucket {bucket} of JetStream stream {self.stream} exists with {has} replica(s), "
                    f"not the {self._replicas} of --jetstream-replicas; change its count first"
                )
        return objects

    async def _delete_snapshot(self) -> None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self._objects.delete(self._snapshot_object)

    async def _tail(self) -> Tail:
        """The snapshot and the chain after it. Read again when the first message found is not the one the snapshot
        names: a newer snapshot purged the messages meanwhile, and the older one's records would be missing."""
        for _ in range(MAX_TAIL_ATTEMPTS):
            tail = await self._read_tail()
            if tail is not None:
                return tail
        raise JournalUnreachable(
            f"{self.subject} does not start where its snapshot says, after {MAX_TAIL_ATTEMPTS} reads: messages the "
            "snapshot does not cover are gone (a newer snapshot kept replacing it, or the stream lost them: check "
            "its limits with `nats stream info`)"
        )

    async def _read_tail(self) -> Tail | None:
        stored = await self.load_snapshot()
        try:
            last = await self._js.get_last_msg(self.stream, self.subject)
        except nats.js.errors.NotFoundError:
            return Tail(stored, (), 0)
        start = stored.replay_from if stored is not None and stored.replay_from else 1
        messages: list[TailMessage] = []
        chain = batch.Chain()
        off_chain = 0
        seen: int | None = None  # the last message read (the first one read follows one purged, or none)
        covered = stored.snapshot.lsn if stored is not None else 0  # the records the snapshot read holds
        while start <= last.seq:
            chunk = await self.fetch(start)
            if not chunk:  # the subject holds messages up to last.seq: none in time is a failed read, not the end
                raise JournalUnreachable(
                    f"JetStream did not deliver {self.subject} from sequence {start} (its last is {last.seq}) within "
                    f"{FETCH_WAIT_SECONDS:g} s; the log was not read whole"
                )
            if not messages and stored is not None and stored.replay_from and chunk[0].seq != stored.replay_from:
                return None  # purged past the snapshot's start: a newer snapshot is stored
            for message in chunk:
                if seen is not None and message.prev > seen:
                    return None  # it follows a message not read: purged meanwhile by a newer snapshot
                if seen is None and message.first_lsn > covered + 1:
                    return None  # the first message starts past what the snapshot read covers: purged meanwhile
                seen = message.seq
                if chain.take(message.seq, message.prev):
                    sizes = tuple(batch.record_sizes(message.body, message.seq))
                    messages.append(TailMessage(message.seq, message.first_lsn, sizes))
                else:
                    off_chain += 1
                    log.warning(
                        "%s: message %d follows %d, not the log's last message %s: passed over (two appends were "
                        "stored on one fence, which nats-server before 2.9.21 allows; its writer acknowledged none "
                        "of it)",
                        self.subject,
                        message.seq,
                        message.prev,
                        chain.tail,
                    )
            start = chunk[-1].seq + 1
        return Tail(stored, tuple(messages), last.seq, chain.tail or 0, off_chain)

    async def load_snapshot(self) -> StoredSnapshot | None:
        try:
            result = await self._objects.get(self._snapshot_object)
        except nats.js.errors.NotFoundError:
            return None
        data: bytes = result.data
        lsn, replay_from = SNAPSHOT_HEADER.unpack_from(data)
        return StoredSnapshot(Snapshot(lsn, data[SNAPSHOT_HEADER.size :]), replay_from)

    async def store_snapshot(self, stored: StoredSnapshot) -> bool:
        """Store the snapshot if it is newer (by the lsn it covers) than the stored one, atomically
        (``jetstream_snapshots``), then purge the messages before ``replay_from``; False, nothing stored and nothing
        purged, if the stored one covers as much or more (a newer owner wrote it)."""
        data = SNAPSHOT_HEADER.pack(stored.snapshot.lsn, stored.replay_from) + stored.snapshot.payload
        bucket = bucket_of(self.stream)
        newer = snapshots.put_if_newer(
            self._js, bucket, self._snapshot_object, data, stored.snapshot.lsn, stored.replay_from
        )
        try:
            if not await asyncio.wait_for(newer, REQUEST_TIMEOUT_SECONDS * 4):
                return False
        except (TimeoutError, nats.errors.Error, snapshots.SnapshotRaced) as exc:
            raise JournalWriteFailed(f"storing the snapshot in JetStream failed ({_why(exc)})") from None
        if stored.replay_from > 1:
            try:  # (purges up to, not including, replay_from: the subject keeps a last message to fence on)
                await self._js.purge_stream(self.stream, subject=self.subject, seq=stored.replay_from)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("purging the journal stream %s before %d failed: %s", self.stream, stored.replay_from, exc)
        return True

    async def publish(self, body: bytes, first_lsn: int, expected_last: int, prev: int) -> int:
        """Publish one group, fenced on ``expected_last``, following ``prev`` on the chain; its stream sequence once
        JetStream acknowledged it and it is on the chain (``JournalFenced`` if another message took its place)."""
        headers = batch.headers(first_lsn, expected_last, prev)
        try:
            ack = await self._js.publish(self.subject, body, timeout=REQUEST_TIMEOUT_SECONDS, headers=headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise JournalFenced(
                    f"JetStream refused the append to {self.subject} in stream {self.stream}: another writer appended "
                    f"to it (this writer expected its last sequence to be {expected_last}; {exc.description}); "
                    "writes stop so the log does not fork"
                ) from None
            raise JournalWriteFailed(f"JetStream refused the append to {self.subject}: {_why(exc)}") from None
        except (TimeoutError, nats.errors.Error) as exc:
            raise JournalWriteFailed(f"publishing to JetStream stream {self.stream} failed: {_why(exc)}") from None
        seq = int(ack.seq)
        if not await self._on_chain(seq, expected_last, prev):
            raise JournalFenced(
                f"JetStream stored the append to {self.subject} at {seq} and another one fenced on the same sequence "
                f"{expected_last} before it (nats-server before 2.9.21 allows that on a clustered stream): this one is "
                "off the log and readers pass over it; writes stop so the log does not fork"
            )
        return seq

    async def _on_chain(self, seq: int, expected_last: int, prev: int) -> bool:
        """Whether the message just stored at ``seq`` is on the chain: no message between the fence and it took
        ``prev``'s successor place. Nothing between them (the usual case) costs one request at most. A walk that
        cannot see every message between them (a snapshot purged some meanwhile) gives no verdict: the write's
        outcome is unknown (``JournalWriteFailed``), as readers may anchor past it."""
        if seq == expected_last + 1:
            return True  # nothing of any subject was stored between them
        chain = batch.Chain(prev if expected_last else None)  # (an empty subject: the first message anchors it)
        at = expected_last
        try:
            while True:
                found = await self._js.get_msg(self.stream, seq=at + 1, subject=self.subject, next=True)
                found_at = int(found.seq)
                found_prev = batch.prev_of(found.headers, found_at)
                if found_prev > at or found_at > seq:
                    raise JournalWriteFailed(
                        f"checking the append to {self.subject} at {seq}: messages after {at} were purged while it "
                        "was checked; whether it is on the log is unknown"
                    )
                at = found_at
                if at == seq:
                    return chain.take(seq, prev)
                chain.take(at, found_prev)
        except (TimeoutError, nats.errors.Error, batch.MalformedBatch) as exc:  # (NotFoundError: it is stored)
            raise JournalWriteFailed(
                f"checking the append to {self.subject} at {seq} failed ({_why(exc)}); whether it is on the log is "
                "unknown"
            ) from None

    async def fetch(self, start_seq: int) -> list[Fetched]:
        """Up to ``READ_CHUNK_MESSAGES`` messages of the subject from ``start_seq``, in order."""
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            ack_policy=js_api.AckPolicy.NONE,
            inactive_threshold=30.0,
        )
        subscription = await self._js.pull_subscribe(self.subject, stream=self.stream, config=config)
        try:
            try:
                messages = await subscription.fetch(READ_CHUNK_MESSAGES, timeout=FETCH_WAIT_SECONDS)
            except nats.errors.TimeoutError:
                return []
        finally:
            await subscription.unsubscribe()
        found = []
        for message in messages:
            seq = message.metadata.sequence.stream
            headers = message.headers
            found.append(Fetched(seq, batch.first_lsn(headers, seq), batch.prev_of(headers, seq), message.data))
        return found

    async def close(self) -> None:
        await asyncio.wait_for(self._nc.close(), REQUEST_TIMEOUT_SECONDS)


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def payloads(messages: Iterable[Fetched]) -> Iterable[tuple[int, bytes]]:
    """(lsn, payload) for every record of ``messages``, in order."""
    for message in messages:
        for offset, payload in enumerate(batch.unframe(message.body, message.seq)):
            yield message.first_lsn + offset, payload
