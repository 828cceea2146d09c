"""The actor side's figures for ``GET /metrics``, read at scrape time from the counters components already keep.

Mailboxes (``ScopeActor``, ``ActorSystem``), the journal (``JournalStatistics`` and its timings), snapshots,
each scope's KV index, the KV listeners (``ListenerStatus``), the replicator (``ReplicaStats``): nothing here
is called on a request's path, and nothing is counted twice. Each function returns ``Family`` values
(plain data: a front process receives them over the wire).

Labels: scopes are ``model_name`` and ``tenant_id`` (at most 10,000 scopes per service), ranks ``worker_id`` and
``dp_rank`` (at most 65,536 per service); a family lists at most ``MAX_SERIES_PER_FAMILY`` series
(``metric_families``), so a scrape stays bounded however many there are.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.index_counters import IndexCounters
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.mailbox import MAILBOX_SIZE
from kvrouter.actors.metric_families import Family, Labels, counter, gauge, histogram
from kvrouter.actors.peers.replicator import Replicator
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.file import FileJournal

SCOPE = ("model_name", "tenant_id")
RANK = ("worker_id", "dp_rank")


def scope_labels(scope: ScopeKey) -> Labels:
    return (scope.model_name, scope.tenant_id)


def system_families(system: ActorSystem) -> list[Family]:
    """Scopes, mailboxes, the journal and snapshots."""
    mailboxes = system.mailboxes()
    depth = {scope_labels(s): float(waiting) for s, waiting, _ in mailboxes}
    peak = {scope_labels(s): float(most) for s, _, most in mailboxes}
    rejected = {scope_labels(s): float(n) for s, n in system.mailbox_rejections.items()}
    families = [
        gauge("kvrouter_scopes", "(model, tenant) scopes with a running actor", (), {(): float(len(mailboxes))}),
        gauge("kvrouter_mailbox_capacity", "Commands a scope's mailbox holds", (), {(): float(MAILBOX_SIZE)}),
        gauge("kvrouter_mailbox_depth", "Commands waiting in the scope's mailbox now", SCOPE, depth),
        gauge("kvrouter_mailbox_peak_depth", "Most commands ever waiting in the scope's mailbox", SCOPE, peak),
        counter(
            "kvrouter_mailbox_rejections",
            "Commands refused (503) because the scope's mailbox stayed full",
            SCOPE,
            rejected,
        ),
    ]
    families += journal_families(system)
    return families


def journal_families(system: ActorSystem) -> list[Family]:
    journal = system.journal
    families = [
        counter("kvrouter_snapshots", "Snapshots written by this process", (), {(): float(system.snapshots_taken)}),
        counter(
            "kvrouter_snapshot_failures",
            "Snapshots that failed in this process",
            (),
            {(): float(system.snapshots_failed)},
        ),
    ]
    report = system.last_snapshot
    if report is not None:
        families += [
            gauge("kvrouter_snapshot_last_bytes", "Payload size of the last snapshot", (), {(): report.payload_bytes}),
            gauge(
                "kvrouter_snapshot_last_pause_seconds",
                "How long the last snapshot held the event loop",
                (),
                {(): report.loop_pause},
            ),
            gauge(
                "kvrouter_snapshot_last_duration_seconds",
                "How long the last snapshot took in all",
                (),
                {(): report.duration},
            ),
            gauge("kvrouter_snapshot_last_lsn", "Journal position the last snapshot covers", (), {(): report.lsn}),
        ]
    if not isinstance(journal, FileJournal):
        return families  # simulations' in-memory journal: no files, no timings
    stats = journal.statistics()
    return [
        *families,
        gauge("kvrouter_journal_last_lsn", "Position of the last record appended", (), {(): stats.last_lsn}),
        gauge(
            "kvrouter_journal_durable_lsn",
            "Position of the last record acknowledged durable",
            (),
            {(): stats.durable_lsn},
        ),
        gauge("kvrouter_journal_pending_bytes", "Bytes appended but not yet written", (), {(): stats.pending_bytes}),
        gauge(
            "kvrouter_journal_peak_pending_bytes",
            "Most bytes ever appended but not yet written",
            (),
            {(): stats.peak_pending_bytes},
        ),
        gauge("kvrouter_journal_segments", "Segment files in the journal", (), {(): stats.segments}),
        gauge(
            "kvrouter_journal_damaged_records_skipped",
            "Damaged records of workers' KV events that recovery skipped at startup (their workers replay them)",
            (),
            {(): stats.damaged_skipped},
        ),
        counter("kvrouter_journal_batches", "Batches written by this process", (), {(): stats.batches_written}),
        counter("kvrouter_journal_fsyncs", "Segment fsyncs by this process", (), {(): stats.fsyncs}),
        counter(
            "kvrouter_journal_inline_batches",
            "Batches the event loop wrote (and, under always, fsynced) itself instead of the journal's I/O thread",
            (),
            {(): stats.inline_batches},
        ),
        histogram(
            "kvrouter_journal_batch_write_seconds",
            "Time to write one batch of records (with its fsync under --durability always)",
            (),
            {(): journal.batch_write_seconds},
        ),
        histogram("kvrouter_journal_fsync_seconds", "Time of one segment fsync", (), {(): journal.fsync_seconds}),
    ]


def index_families(system: ActorSystem, counters: IndexCounters) -> list[Family]:
    """Blocks each scope's KV-event index holds per tier, its predicted blocks, and what its cap cost."""
    blocks: dict[Labels, float] = {}
    predicted: dict[Labels, float] = {}
    for state in system.states():
        labels = scope_labels(state.scope)
        index = state.selection.index
        for tier in Tier:
            blocks[(*labels, tier.name.lower())] = float(index.block_count(tier=tier))
        predicted[labels] = float(state.selection.predicted.block_count())
    evicted = {scope_labels(s): float(e) for s, (e, _) in counters.by_scope.items()}
    refused = {scope_labels(s): float(r) for s, (_, r) in counters.by_scope.items()}
    return [
        gauge(
            "kvrouter_kv_index_blocks",
            "Blocks the scope's KV-event index holds (a block two ranks hold counts twice)",
            (*SCOPE, "tier"),
            blocks,
        ),
        gauge(
            "kvrouter_kv_predicted_blocks", "Predicted blocks (booked without KV events) in the scope", SCOPE, predicted
        ),
        counter(
            "kvrouter_kv_index_evicted_blocks",
            "Blocks the scope's index trimmed at its cap (--max-index-blocks-per-scope)",
            SCOPE,
            evicted,
        ),
        counter("kvrouter_kv_index_refused_blocks", "Blocks the scope's index refused at its cap", SCOPE, refused),
    ]


LISTENER_STATES = ("connecting", "active", "failed")


def listener_families(ingest: KvIngest) -> list[Family]:
    """Per worker rank: its KV-event listener's state, what it delivered and what it lost or refused."""
    state: dict[Labels, float] = {}
    by_state: dict[Labels, float] = {(s,): 0.0 for s in LISTENER_STATES}
    batches: dict[Labels, float] = {}
    replayed: dict[Labels, float] = {}
    gaps: dict[Labels, float] = {}
    lost: dict[Labels, float] = {}
    rejected: dict[Labels, float] = {}
    restarts: dict[Labels, float] = {}
    disconnects: dict[Labels, float] = {}
    for rank, status in ingest.listener_statuses():
        labels = (str(rank.worker_id), str(rank.dp_rank))
        state[(*labels, status.state)] = 1.0
        by_state[(status.state,)] = by_state.get((status.state,), 0.0) + 1
        batches[labels] = status.batches
        replayed[labels] = status.replayed_batches
        gaps[labels] = status.gaps
        lost[labels] = status.lost_batches
        rejected[(*labels, "malformed")] = status.malformed
        rejected[(*labels, "stale")] = status.stale_dropped
        restarts[labels] = status.restarts
        disconnects[labels] = status.disconnects
    return [
        gauge("kvrouter_kv_listeners", "KV-event listeners per state", ("state",), by_state),
        gauge(
            "kvrouter_kv_listener_state",
            "1 for the rank's listener's current state (connecting, active, failed)",
            (*RANK, "state"),
            state,
        ),
        counter("kvrouter_kv_batches", "KV-event batches delivered in order to the scope's actor", RANK, batches),
        counter("kvrouter_kv_batches_replayed", "Of those, batches fetched from the replay endpoint", RANK, replayed),
        counter(
            "kvrouter_kv_sequence_gaps", "Times a batch's sequence number skipped ahead (a replay follows)", RANK, gaps
        ),
        counter("kvrouter_kv_batches_lost", "Sequence numbers never delivered (no replay, or a short one)", RANK, lost),
        counter(
            "kvrouter_kv_batches_rejected",
            "Messages dropped: malformed, or stale (already delivered)",
            (*RANK, "reason"),
            rejected,
        ),
        counter(
            "kvrouter_kv_publisher_restarts", "Publisher restarts detected (the rank's blocks dropped)", RANK, restarts
        ),
        counter("kvrouter_kv_listener_disconnects", "Established listener connections lost", RANK, disconnects),
    ]


def replica_families(replicator: Replicator | None) -> list[Family]:
    """Replica sync: messages published, received, applied and dropped (by reason), per peer link."""
    if replicator is None:
        return [gauge("kvrouter_replica_sync_enabled", "1 when replica sync runs", (), {(): 0.0})]
    stats = replicator.stats
    dropped: dict[Labels, float] = {(reason,): float(n) for reason, n in stats.dropped.items()}
    dropped[("outbox_full",)] = float(stats.outbox_dropped)
    dropped[("unpublishable",)] = float(stats.unpublishable)
    links = replicator.peer_stats()
    peer_received: dict[Labels, float] = {(endpoint,): float(link.received) for endpoint, link in links.items()}
    peer_disconnects: dict[Labels, float] = {(endpoint,): float(link.disconnects) for endpoint, link in links.items()}
    return [
        gauge("kvrouter_replica_sync_enabled", "1 when replica sync runs", (), {(): 1.0}),
        gauge("kvrouter_replica_peers", "Registered replica peers", (), {(): float(len(replicator.peers()))}),
        counter(
            "kvrouter_replica_messages_sent", "Messages handed to the replica PUB socket", (), {(): stats.published}
        ),
        counter("kvrouter_replica_messages_received", "Messages read from replica peers", (), {(): stats.received}),
        counter(
            "kvrouter_replica_messages_applied", "Received messages handed to a scope's actor", (), {(): stats.applied}
        ),
        counter(
            "kvrouter_replica_messages_dropped",
            "Messages dropped, by reason (outbox_full and unpublishable are outgoing)",
            ("reason",),
            dropped,
        ),
        counter("kvrouter_replica_peer_messages_received", "Messages read from each peer", ("peer",), peer_received),
        counter(
            "kvrouter_replica_peer_disconnects",
            "Established connections to each peer lost",
            ("peer",),
            peer_disconnects,
        ),
    ]


def gathered(*sources: Iterable[Family]) -> list[Family]:
    return [family for source in sources for family in source]
