"""Discovery: keep the catalog's discovered workers equal to what a source shows (etcd in Dynamo's layout, or a
watched file), through the selection service like any registration (journaled, one writer).

``CatalogSync.apply(wanted)`` is the one way in: it removes the source's workers that are no longer wanted (which
frees what they held: their bookings and indexed blocks), then puts each new or changed record, then tells the
event plane where the workers' KV events come from. It compares with the catalog itself (every record naming the
source in ``discovered_by``), so a restart reconciles a recovered catalog with the source's first list.

The etcd source lists the layout's prefix, then watches from the list's revision + 1, so no change falls between
the two; a compacted revision makes it list again. While etcd cannot be reached (``EtcdUnavailable``, or the
liveness probe failing under a silent watch) the catalog stays as it was and the status says so (``/ready``,
``/metrics``, one log line when it starts and one when it ends); it retries with a doubling backoff and resumes the
watch from the last revision it saw. A lease that expired meanwhile shows as the deletions the resumed watch brings.

The file source polls a JSON or YAML list of worker records (the fields of ``POST /workers``) and applies it when it
changes; a file that cannot be read keeps the last catalog and says why.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.fleet.dynamo_layout import LAYOUT_PREFIX, DiscoveredWorker, Layout
from kvrouter.actors.fleet.etcd import Change, Compacted, EtcdClient, EtcdUnavailable
from kvrouter.actors.fleet.worker_file import FileParser, read_worker_file
from kvrouter.actors.mailbox import Overloaded, ReplyTimeout
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.service_support import Refused

log = logging.getLogger("kvrouter.discovery")

RETRY_FIRST_SECONDS: Final = 0.5
RETRY_MAX_SECONDS: Final = 10.0
# A watch that stays silent is probed this often (a tiny range request): a dead etcd is noticed within ~this.
PROBE_SECONDS: Final = 2.0
FILE_POLL_SECONDS: Final = 1.0

OnWorkers = Callable[[Mapping[int, DiscoveredWorker]], None]


@attrs.define
class DiscoveryStatus:
    """What ``/ready`` and ``/metrics`` say about one discovery source."""

    backend: str  # "etcd" or "file"
    source: str  # the endpoints, or the file
    namespace: str | None = None
    state: str = "syncing"  # syncing, synced, unreachable (etcd), invalid (file)
    since: float = attrs.Factory(time.time)  # when the state began (unix seconds)
    last_error: str | None = None
    revision: int = 0  # etcd: the last revision seen
    workers: int = 0  # discovered workers in the catalog
    skipped: int = 0  # entries or cards left out (their reasons are logged)
    refused: int = 0  # catalog writes the service refused (logged)
    outages: int = 0  # times the source became unreachable or invalid
    syncs: int = 0  # times the catalog was brought in line with the source

    def enter(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()
            if state in ("unreachable", "invalid"):
                self.outages += 1
        self.last_error = error

    def view(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "source": self.source,
            **({"namespace": self.namespace} if self.namespace is not None else {}),
            "state": self.state,
            "since": round(self.since, 3),
            "last_error": self.last_error,
            "workers": self.workers,
            **({"revision": self.revision} if self.backend == "etcd" else {}),
        }


class CatalogSync:
    def __init__(self, service: SelectService, source: str, status: DiscoveryStatus, on_workers: OnWorkers) -> None:
        self._service = service
        self._source = source
        self._status = status
        self._on_workers = on_workers
        self._refusals: dict[int, str] = {}  # worker id -> the refusal last logged for it

    def _current(self) -> dict[int, WorkerRecord]:
        return {
            record.worker_id: record
            for state in self._service.system.states()
            for record in state.selection.catalog.values()
            if record.discovered_by == self._source
        }

    async def apply(self, wanted: Mapping[int, DiscoveredWorker]) -> bool:
        """Bring the catalog in line with ``wanted``; False if a write must be tried again later (overloaded)."""
        current = self._current()
        complete = True
        for worker_id in sorted(current.keys() - wanted.keys()):
            try:
                await self._service.remove_worker(worker_id, discovered_by=self._source)
                log.info("discovery: worker %d left (%s)", worker_id, current[worker_id].model_name)
            except Refused as exc:
                if exc.reason is not Reason.NOT_FOUND:
                    self._refused(worker_id, exc.message)
            except (Overloaded, ReplyTimeout):
                complete = False
        placed: dict[int, DiscoveredWorker] = {}
        for worker_id, worker in sorted(wanted.items()):
            if current.get(worker_id) == worker.record:
                placed[worker_id] = worker
                continue
            try:
                await self._service.put_worker(worker.record)
            except Refused as exc:
                self._refused(worker_id, exc.message)
                continue
            except (Overloaded, ReplyTimeout):
                complete = False
                continue
            self._refusals.pop(worker_id, None)
            placed[worker_id] = worker
            verb = "changed" if worker_id in current else "joined"
            record = worker.record
            log.info(
                "discovery: worker %d %s: model %s, block size %s, %d dp rank(s), %d KV-event publisher(s)",
                worker_id,
                verb,
                record.model_name,
                record.block_size,
                record.dp_size,
                len(worker.publishers),
            )
        self._status.workers = len(placed)
        self._status.syncs += 1
        self._on_workers(placed)
        return complete

    async def apply_fully(self, wanted: Mapping[int, DiscoveredWorker]) -> None:
        """``apply`` until no write is left to try again (a full mailbox or a slow journal makes some wait)."""
        while True:
            if await self.apply(wanted):
                return
            await trio.sleep(RETRY_FIRST_SECONDS)

    def _refused(self, worker_id: int, message: str) -> None:
        self._status.refused += 1
        if self._refusals.get(worker_id) != message:
            self._refusals[worker_id] = message
            log.warning("discovery: worker %d not taken: %s", worker_id, message)


class EtcdDiscovery:
    def __init__(
        self,
        client: EtcdClient,
        namespace: str,
        sync: CatalogSync,
        status: DiscoveryStatus,
        kv_events_endpoint: str | None,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._sync = sync
        self.status = status
        self._kv_events_endpoint = kv_events_endpoint
        self.layout = Layout(namespace)
        self._skipped: dict[str, str] = {}  # key -> reason logged

    async def run(self, *, task_status: trio.TaskStatus[EtcdDiscovery] = trio.TASK_STATUS_IGNORED) -> None:
        """List and watch until cancelled; ``started`` once the first list was tried (whatever came of it)."""
        revision = 0
        delay = RETRY_FIRST_SECONDS
        started = False
        while True:
            try:
                if revision == 0:
                    revision = await self._list()
                elif self.status.state != "synced":
                    await self._client.revision()  # a round trip before etcd is said to be back (and the delay reset)
                if not started:
                    started = True
                    task_status.started(self)
                if self.status.state != "synced":
                    self._recovered()
                delay = RETRY_FIRST_SECONDS
                await self._watch(revision)
            except Compacted as exc:
                log.info("discovery: etcd %s; listing again", exc)
                revision = 0
            except EtcdUnavailable as exc:
                revision = self.status.revision  # resume after the last change seen
                self._unreachable(str(exc))
                if not started:
                    started = True
                    task_status.started(self)
                await trio.sleep(delay)
                delay = min(RETRY_MAX_SECONDS, delay * 2)

    async def _list(self) -> int:
        revision, entries = await self._client.list_prefix(LAYOUT_PREFIX)
        self.layout = Layout(self._namespace)
        for key, value in entries:
            self._note(key, self.layout.put(key, value))
        self.status.revision = revision
        await self._apply()
        log.info(
            "discovery: listed etcd %s at revision %d: %d workers in namespace %s",
            self._client.endpoint,
            revision,
            self.status.workers,
            self._namespace,
        )
        return revision

    async def _watch(self, revision: int) -> None:
        """Watch from ``revision + 1`` while a probe checks that etcd answers, until either fails: raises
        EtcdUnavailable (naming the last revision seen, which ``status.revision`` keeps) or Compacted."""
        seen = revision

        async def on_changes(changes: list[Change], at: int) -> None:
            nonlocal seen
            for change in changes:
                if change.value is None:
                    self.layout.delete(change.key)
                else:
                    self._note(change.key, self.layout.put(change.key, change.value))
            # Only the changes' own revisions count: a message's header may name a later revision whose changes
            # are still on their way, and resuming after it would skip them.
            seen = max([seen, *(change.revision for change in changes)])
            self.status.revision = seen
            if changes:
                await self._apply()

        failure: list[EtcdUnavailable | Compacted] = []

        async def probe(cancel: trio.CancelScope) -> None:
            while True:
                await trio.sleep(PROBE_SECONDS)
                try:
                    await self._client.revision()
                except EtcdUnavailable as exc:
                    failure.append(exc)
                    cancel.cancel()
                    return

        # Errors are caught where they happen (a nursery would wrap them in an exception group).
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, nursery.cancel_scope)
            try:
                await self._client.watch(LAYOUT_PREFIX, revision + 1, on_changes)
            except (EtcdUnavailable, Compacted) as exc:
                failure.append(exc)
            nursery.cancel_scope.cancel()
        if isinstance(failure[0], Compacted):
            raise failure[0]
        raise EtcdUnavailable(f"{failure[0]} (after revision {seen})")

    async def _apply(self) -> None:
        workers, skipped = self.layout.workers(kv_events_endpoint=self._kv_events_endpoint)
        for worker_id, why in skipped.items():
            self._note(f"worker {worker_id}", why)
        self.status.skipped = len(self._skipped)
        await self._sync.apply_fully(workers)

    def _note(self, key: str, why: str | None) -> None:
        if why is None:
            self._skipped.pop(key, None)
        elif self._skipped.get(key) != why:
            self._skipped[key] = why
            log.warning("discovery: skipped %s", why if why.startswith(key) else f"{key}: {why}")

    def _unreachable(self, error: str) -> None:
        if self.status.state != "unreachable":
            log.warning(
                "discovery: etcd unreachable (%s); keeping the last known catalog of %d workers and retrying",
                error,
                self.status.workers,
            )
        self.status.enter("unreachable", error)

    def _recovered(self) -> None:
        if self.status.state == "unreachable":
            down = time.time() - self.status.since
            log.info(
                "discovery: etcd reachable again after %.1f s; watching from revision %d", down, self.status.revision
            )
        self.status.enter("synced")


# -- a watched file ------------------------------------------------------------------------------------------------


class FileDiscovery:
    def __init__(self, path: Path, parse: FileParser, sync: CatalogSync, status: DiscoveryStatus) -> None:
        self._path = path
        self._parse = parse
        self._sync = sync
        self.status = status
        self._seen: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) last read

    async def run(self, *, task_status: trio.TaskStatus[FileDiscovery] = trio.TASK_STATUS_IGNORED) -> None:
        await self._check()
        task_status.started(self)
        while True:
            await trio.sleep(FILE_POLL_SECONDS)
            await self._check()

    async def _check(self) -> None:
        try:
            stat = await trio.to_thread.run_sync(os.stat, self._path)
        except OSError as exc:
            self._invalid(f"cannot read {self._path}: {exc.strerror or exc}")
            return
        seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if seen == self._seen and self.status.state == "synced":
            return
        try:
            records = await trio.to_thread.run_sync(read_worker_file, self._path, self._parse)
        except (OSError, ValueError) as exc:
            self._seen = seen
            self._invalid(str(exc))
            return
        self._seen = seen
        wanted = {r.worker_id: DiscoveredWorker(attrs.evolve(r, discovered_by="file")) for r in records}
        await self._sync.apply_fully(wanted)
        if self.status.state != "synced":
            log.info("discovery: %s read: %d workers", self._path, len(wanted))
        self.status.enter("synced")

    def _invalid(self, error: str) -> None:
        if self.status.state != "invalid" or self.status.last_error != error:
            log.warning("discovery: %s; keeping the last known catalog of %d workers", error, self.status.workers)
        self.status.enter("invalid", error)


def up(status: DiscoveryStatus) -> float:
    return 1.0 if status.state == "synced" else 0.0


def since_seconds(status: DiscoveryStatus) -> float:
    return max(0.0, time.time() - status.since) if math.isfinite(status.since) else 0.0
