"""Dynamo's NATS event plane: the ``kv-events`` subjects of a namespace, read live or through kvrouter's JetStream
stream, handed to ``EventPlaneIngest``.

Dynamo 1.6.1 publishes on plain core NATS (no stream, no consumer): what is published while kvrouter is down is
gone. So when the server has JetStream, kvrouter keeps a stream of its own over the namespace's ``kv-events``
subjects and reads it through a durable consumer:

* the stream (``KVROUTER_<NAMESPACE>_KV_EVENTS``, created or updated idempotently; replicas of kvrouter share it) is
  bounded in age and bytes (``--jetstream-max-age-secs``, ``--jetstream-max-bytes``) with the discard-old policy:
  the oldest envelopes go first, and an envelope gone before kvrouter read it shows as a lost gap on its worker;
* the durable consumer (one per kvrouter data directory) acknowledges with ack-all, after the journal record of what
  was applied is durable, so a restart (even kill -9) resumes where the journal's watermarks left it: the consumer
  redelivers from its acknowledged floor and each publisher's journaled watermark drops what was applied already.
  A journal that starts empty (``--fresh``, or a new data directory) resets the consumer to the start of the stream.

Without JetStream (or with ``--no-jetstream``) the plane subscribes to the same subjects on core NATS; envelopes
published while kvrouter is away are then lost, and counted per worker once a later one shows the gap.

The subjects: every ``kv-events`` subject of the namespace (``namespace.{ns}.component.*.endpoint.*.kv-events``),
plus any subject a discovered event channel names outside that pattern. nats-py runs on its own asyncio thread
(``asyncio_bridge``); trio crosses to it once per fetched batch and once per acknowledgement.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
import nats
import nats.errors
import nats.js.errors
import trio
from nats.js import api as js_api

from kvrouter.actors.fleet.asyncio_bridge import AsyncioThread, Inbox
from kvrouter.actors.fleet.dynamo_events import Envelope, EnvelopeError, decode_envelope
from kvrouter.actors.fleet.dynamo_layout import KV_EVENTS_TOPIC
from kvrouter.actors.fleet.event_ingest import EventPlaneIngest
from kvrouter.actors.fleet.options import JetStreamSettings

log = logging.getLogger("kvrouter.event_plane")

# Core NATS: what the subscription callbacks may queue for the ingest task (policy: drop the newest, counted; the
# sequence numbers then show the loss on each worker).
INBOX_MAX_BYTES: Final = 16 * 1024 * 1024
# JetStream: messages per fetch (one crossing to the asyncio thread, one command run per publisher, one ack), and
# how long one fetch waits for the first message.
FETCH_BATCH: Final = 256
FETCH_WAIT_SECONDS: Final = 1.0
# Delivered but not yet acknowledged messages the consumer allows (it stops delivering beyond).
MAX_ACK_PENDING: Final = 4 * FETCH_BATCH
ACK_WAIT_SECONDS: Final = 30.0
# A consumer nobody reads for this long is deleted by the server (a kvrouter gone for good, or one whose journal was
# in memory); a kvrouter that comes back later gets a new one, which reads the stream from its start.
INACTIVE_THRESHOLD_SECONDS: Final = 24 * 3600.0
# (Re)connecting: the first try, then doubling up to the last.
RETRY_FIRST_SECONDS: Final = 0.5
RETRY_MAX_SECONDS: Final = 10.0
CONNECT_TIMEOUT_SECONDS: Final = 2


def namespace_subjects(namespace: str) -> str:
    return f"namespace.{namespace}.component.*.endpoint.*.{KV_EVENTS_TOPIC}"


def stream_name(namespace: str) -> str:
    """A JetStream name for the namespace: letters, digits, ``_`` and ``-`` only."""
    return "KVROUTER_" + re.sub(r"[^A-Za-z0-9_-]", "_", namespace).upper() + "_KV_EVENTS"


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching (``*`` one token, ``>`` the rest)."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(tokens) == len(wanted)


@attrs.define
class NatsStatus:
    servers: str
    state: str = "connecting"  # connecting, connected, disconnected
    last_error: str | None = None
    jetstream: bool = False
    subjects: tuple[str, ...] = ()  # read now (subscribed on core NATS, or captured by the stream)
    stream: str | None = None
    consumer: str | None = None
    messages: int = 0
    unreadable: int = 0
    inbox_dropped: int = 0
    disconnects: int = 0


class NatsPlane:
    def __init__(
        self,
        ingest: EventPlaneIngest,
        servers: list[str],
        namespace: str,
        jetstream: JetStreamSettings,
        *,
        wait_durable: Callable[[int], Awaitable[None]],
        reset_consumer: bool = False,
    ) -> None:
        self._ingest = ingest
        self._servers = servers
        self._namespace = namespace
        self._settings = jetstream
        self._wait_durable = wait_durable
        self._reset_consumer = reset_consumer
        self.status = NatsStatus(",".join(servers))
        self._thread = AsyncioThread("kvrouter-nats")
        self._inbox = Inbox(INBOX_MAX_BYTES)
        self._subjects: list[str] = [namespace_subjects(namespace)]
        self._subjects_changed = trio.Event()
        # asyncio side only (touched inside ``AsyncioThread.call``):
        self._nc: Any = None
        self._js: Any = None
        self._pull: Any = None
        self._subs: dict[str, Any] = {}
        self._closing = False

    def reading(self, subject: str) -> bool:
        """Whether ``subject`` is read now: every followed subject is, while the connection is up."""
        return self.status.state == "connected"

    def follow(self, subjects: set[str]) -> None:
        """The subjects discovered channels name; those outside the namespace pattern are read too."""
        pattern = namespace_subjects(self._namespace)
        wanted = [pattern, *sorted(s for s in subjects if not matches(pattern, s))]
        if wanted != self._subjects:
            self._subjects = wanted
            self._subjects_changed.set()

    async def run(self, *, task_status: trio.TaskStatus[NatsPlane] = trio.TASK_STATUS_IGNORED) -> None:
        await self._thread.start()
        self._inbox.bind()
        try:
            task_status.started(self)
            await self._connect()
            jetstream = self._settings.enabled and await self._thread.call(self._has_jetstream)
            if jetstream and await self._set_up_jetstream():
                await self._consume_jetstream()
            else:
                await self._consume_core()
        finally:
            with trio.CancelScope(shield=True):
                await self._thread.stop(self._close)

    # -- connecting ----------------------------------------------------------------------------------------

    async def _connect(self) -> None:
        delay = RETRY_FIRST_SECONDS
        while True:
            try:
                await self._thread.call(self._open)
            except Exception as exc:  # nats-py raises its own errors and OSError for an unreachable server
                if self.status.last_error is None:
                    log.warning("event plane: NATS %s unreachable (%s); retrying", self.status.servers, _why(exc))
                self.status.last_error = f"cannot connect: {_why(exc)}"
                await trio.sleep(delay)
                delay = min(RETRY_MAX_SECONDS, delay * 2)
                continue
            self.status.state = "connected"
            self.status.last_error = None
            log.info("event plane: connected to NATS %s", self.status.servers)
            return

    async def _open(self) -> None:
        status = self.status

        async def disconnected() -> None:
            if self._closing:
                return
            status.state = "disconnected"
            status.disconnects += 1
            log.warning("event plane: NATS connection lost; nats-py reconnects")

        async def reconnected() -> None:
            status.state = "connected"
            log.info("event plane: NATS reconnected")

        async def error(exc: Exception) -> None:
            status.last_error = _why(exc)

        self._nc = await nats.connect(
            self._servers,
            name="kvrouter",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
        )

    async def _close(self) -> None:
        self._closing = True
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()

    # -- core NATS -----------------------------------------------------------------------------------------

    async def _consume_core(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_subscribed)
            while True:
                messages = await self._inbox.take()
                self.status.inbox_dropped = self._inbox.dropped
                await self._ingest.ingest(self._envelopes(messages))

    async def _keep_subscribed(self) -> None:
        while True:
            self._subjects_changed = trio.Event()
            await self._thread.call(self._subscribe, list(self._subjects))
            self.status.subjects = tuple(self._subjects)
            log.info("event plane: subscribed to %s on core NATS", ", ".join(self._subjects))
            await self._subjects_changed.wait()

    async def _subscribe(self, subjects: list[str]) -> None:
        for subject in [s for s in self._subs if s not in subjects]:
            await self._subs.pop(subject).unsubscribe()
        inbox = self._inbox

        async def received(msg: Any) -> None:
            inbox.put(msg.data)

        for subject in subjects:
            if subject not in self._subs:
                self._subs[subject] = await self._nc.subscribe(subject, cb=received)
        await self._nc.flush()

    def _envelopes(self, messages: list[bytes]) -> list[Envelope]:
        envelopes = []
        self.status.messages += len(messages)
        for data in messages:
            try:
                envelopes.append(decode_envelope(data))
            except EnvelopeError as exc:
                self.status.unreadable += 1
                self._ingest.unreadable += 1
                log.debug("event plane: message skipped: %s", exc)
        return envelopes

    # -- JetStream -----------------------------------------------------------------------------------------

    async def _has_jetstream(self) -> bool:
        self._js = self._nc.jetstream()
        try:
            await self._js.account_info()
        except Exception as exc:  # no JetStream: NoRespondersError, ServiceUnavailableError, APIError
            log.info("event plane: the NATS server has no JetStream (%s); reading core NATS", _why(exc))
            return False
        return True

    async def _set_up_jetstream(self) -> bool:
        stream = stream_name(self._namespace)
        try:
            outcome = await self._thread.call(self._ensure_stream, stream, list(self._subjects))
            await self._thread.call(self._ensure_consumer, stream, self._settings.durable, self._reset_consumer)
        except Exception as exc:  # e.g. another stream already captures these subjects
            log.warning("event plane: cannot use JetStream (%s); reading core NATS, without catch-up", _why(exc))
            self.status.last_error = f"JetStream unusable: {_why(exc)}"
            return False
        self.status.jetstream, self.status.stream, self.status.consumer = True, stream, self._settings.durable
        self.status.subjects = tuple(self._subjects)
        self._ingest.jetstream = True
        log.info(
            "event plane: JetStream stream %s %s (max age %gs, max %d bytes, discard old), durable consumer %s",
            stream,
            outcome,
            self._settings.max_age_secs,
            self._settings.max_bytes,
            self._settings.durable,
        )
        return True

    def _stream_config(self, name: str, subjects: list[str]) -> Any:
        return js_api.StreamConfig(
            name=name,
            subjects=subjects,
            retention=js_api.RetentionPolicy.LIMITS,
            max_age=self._settings.max_age_secs,
            max_bytes=self._settings.max_bytes,
            discard=js_api.DiscardPolicy.OLD,
            storage=js_api.StorageType.FILE,
            num_replicas=1,
        )

    async def _ensure_stream(self, name: str, subjects: list[str]) -> str:
        config = self._stream_config(name, subjects)
        try:
            info = await self._js.stream_info(name)
        except nats.js.errors.NotFoundError:
            await self._js.add_stream(config)
            return "created"
        held = info.config
        same = (
            sorted(held.subjects or []) == sorted(subjects)
            and held.max_bytes == config.max_bytes
            and abs((held.max_age or 0) - config.max_age) < 1e-3
            and held.discard == config.discard
        )
        if same:
            return "found"
        # Keep what other replicas capture: the union of subjects.
        config.subjects = sorted(set(held.subjects or []) | set(subjects))
        await self._js.update_stream(config)
        return "updated"

    async def _ensure_consumer(self, stream: str, durable: str, reset: bool) -> None:
        if reset:
            try:
                await self._js.delete_consumer(stream, durable)
                log.info("event plane: the journal starts empty: consumer %s reset to the start of the stream", durable)
            except nats.js.errors.NotFoundError:
                pass
        try:
            await self._js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            config = js_api.ConsumerConfig(
                name=durable,
                durable_name=durable,
                deliver_policy=js_api.DeliverPolicy.ALL,
                ack_policy=js_api.AckPolicy.ALL,
                ack_wait=ACK_WAIT_SECONDS,
                max_ack_pending=MAX_ACK_PENDING,
                inactive_threshold=INACTIVE_THRESHOLD_SECONDS,
            )
            await self._js.add_consumer(stream, config=config)
        self._pull = await self._js.pull_subscribe_bind(durable=durable, stream=stream)

    async def _consume_jetstream(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_stream_subjects)
            delay = RETRY_FIRST_SECONDS
            while True:
                try:
                    messages = await self._thread.call(self._fetch)
                except Exception as exc:  # disconnected: nats-py reconnects; fetch again after a pause
                    self.status.last_error = f"fetch failed: {_why(exc)}"
                    await trio.sleep(delay)
                    delay = min(RETRY_MAX_SECONDS, delay * 2)
                    continue
                delay = RETRY_FIRST_SECONDS
                if not messages:
                    continue
                lsn = await self._ingest.ingest(self._envelopes([message.data for message in messages]))
                if lsn:
                    await self._wait_durable(lsn)  # acknowledged only once the journal holds what was applied
                try:
                    await self._thread.call(messages[-1].ack)  # ack-all: every earlier message too
                except Exception as exc:  # redelivered later, then dropped by the watermarks
                    self.status.last_error = f"ack failed: {_why(exc)}"

    async def _fetch(self) -> list[Any]:
        try:
            messages: list[Any] = await self._pull.fetch(FETCH_BATCH, timeout=FETCH_WAIT_SECONDS)
        except nats.errors.TimeoutError:
            return []
        return messages

    async def _keep_stream_subjects(self) -> None:
        stream = stream_name(self._namespace)
        while True:
            self._subjects_changed = trio.Event()
            await self._subjects_changed.wait()
            try:
                await self._thread.call(self._ensure_stream, stream, list(self._subjects))
                self.status.subjects = tuple(self._subjects)
            except Exception as exc:
                log.warning("event plane: cannot add subjects to stream %s: %s", stream, _why(exc))


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
