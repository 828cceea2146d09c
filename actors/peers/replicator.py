"""Replica sync with Dynamo 1.6.1 peers (docs/operations/replicas.md): publish local lifecycle decisions, apply peers'.

Outbound: an observer of the actor system turns every *local* applied admission, prefill completion
and free into a 1.6.1 message and drops it into a bounded outbox; one task owns the PUB socket and
drains it. Expiry, worker (un)registration, the catalog, output blocks and KV events are never
published, exactly as in 1.6.1. Inbound: one task per peer owns a SUB socket, decodes, applies 1.6.1's
drop rules and hands the command to the scope's actor marked ``remote`` (so it is journaled but never
re-published, which is what keeps two peered replicas from echoing forever).

Session affinity (the selection service, ``session_ttl_ns`` > 0): every local pin or refresh of a session,
and the end of a booking that held one, is published on 1.6.1's affinity topic with the binding's version
``(sequence, writer_id)``; peers' bindings are subscribed to and applied as ``BindSession`` (newest version
wins, the receiver's own TTL and clock) under the same rules as the other messages: per-peer size and rate
limits and CURVE on the link, and a binding for a partition or rank this replica does not have, or written
by this replica, is dropped. A peer's binding is journaled when applied, never re-published.

Replica sync is best-effort by design, in 1.6.1 and here: no acks, no replay, no ordering across
publishers, and a subscriber misses what was published before it connected (ZMQ slow joiner). Each
replica's journal is its own truth; this only keeps peers' load views close.

Deliberate differences from 1.6.1 (observed on a live 1.6.1 slot tracker): a repeated prefill-complete
is a no-op decision here and is not re-published (1.6.1 publishes it again; receivers ignore it either
way), and an inbound free or prefill-complete is applied by request id, whereas 1.6.1 ignores one that
names a rank other than the request's (request ids are unique per scope, so only a confused publisher
can tell the difference, and checking the rank here would race with adds still queued in the mailbox).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any, Final

import attrs
import trio
import zmq

from kvrouter.actors.core.commands import (
    AddRequest,
    BindSession,
    Command,
    CompletePrefill,
    FreeRequest,
    SelectWorker,
)
from kvrouter.actors.core.events import (
    Event,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    SessionBound,
    SessionReleased,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.limits import text_too_long
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.mailbox import MAILBOX_SIZE
from kvrouter.actors.peers.curve import CurveIdentity, RefusalLog, TrustedPeers, zap_domain
from kvrouter.actors.peers.peer_limits import PeerLimits
from kvrouter.actors.peers.peer_link import CurveClient, LinkStats, PeerLink
from kvrouter.actors.peers.replica_wire import (
    AFFINITY_TOPIC,
    TOPIC,
    AddRequestData,
    EventData,
    Free,
    MarkPrefillCompleted,
    PrefillLoadHint,
    ReplicaEvent,
    ReplicaWireError,
    SessionAffinity,
    decode_message,
    encode,
    encode_affinity,
)
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket

log = logging.getLogger("kvrouter.replica")

# Encoded messages waiting for the PUB owner task. The observer runs inside an actor's turn and must
# never wait, so on overflow the newest message is dropped and counted (policy: drop newest). That
# loses load information a peer would have had, which 1.6.1 also does (it is best-effort); a burst
# this large means the PUB task is starved, and peers' views heal as requests are freed or expire.
OUTBOX_SIZE: Final = 10_000

# ZMQ high-water marks (messages per peer pipe), explicit on both ends. A PUB drops silently at
# SNDHWM; a full SUB (RCVHWM) makes the publisher drop. 1.6.1 buffers up to 100 000 inbound events
# before dropping; ours wait in the kernel/zmq instead, because the reader blocks on the mailbox.
REPLICA_HWM: Final = 10_000

# Request ids of remote admissions handed to an actor but not yet applied, per scope: a free or a
# prefill-complete for one of them is not "unknown" (it may arrive before the admission is applied).
# Bounded: a mailbox holds MAILBOX_SIZE commands; beyond this many the oldest is forgotten (an admission
# that was a no-op, e.g. a duplicate, never leaves otherwise).
INFLIGHT_ADDS_PER_SCOPE: Final = 4 * MAILBOX_SIZE

_SCHEMES: Final = ("tcp", "ipc", "inproc")
_LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "::1", "[::1]")


@attrs.frozen
class CurveSettings:
    """CURVE on the replica sockets: our identity and the replicas we trust."""

    identity: CurveIdentity
    trusted: TrustedPeers


@attrs.frozen
class ReplicaSecurity:
    """How much a replica peer is trusted: CURVE (None: plain 1.6.1 wire) and the per-peer limits."""

    curve: CurveSettings | None = None
    limits: PeerLimits = attrs.Factory(PeerLimits)


class PeerLimitError(Exception):
    """A peer registration beyond ``PeerLimits.max_peers``; ``str`` is the one-line reason."""


class DropReason:
    """Why an inbound message was not applied (1.6.1's receiver rules, plus undecodable input)."""

    MALFORMED = "malformed"
    OWN_ROUTER = "own_router"
    UNKNOWN_SCOPE = "unknown_scope"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    UNREGISTERED_RANK = "unregistered_rank"
    UNKNOWN_REQUEST = "unknown_request"  # a free or prefill-complete for a request this replica does not have
    OVER_LIMIT = "over_limit"  # a request id longer than the API accepts (actors/core/limits.py)
    RATE_LIMITED = "rate_limited"  # over the peer's rate (see peer_limits)
    AFFINITY_DISABLED = "affinity_disabled"  # a session binding, but this replica keeps none


@attrs.define
class ReplicaStats:
    """Counters for metrics and tests. ``applied`` means handed to the scope's actor: the core may
    still find it a no-op (a duplicate add, a free of an unknown request), as 1.6.1 ignores those."""

    published: int = 0  # handed to the PUB socket (zmq may still drop at SNDHWM or without subscribers)
    outbox_dropped: int = 0  # outbox full: newest dropped
    unpublishable: int = 0  # a prefill-complete/free whose request's rank is unknown here
    received: int = 0
    applied: int = 0
    dropped: dict[str, int] = attrs.Factory(dict)
    refused_subscribers: int = 0  # CURVE handshakes our PUB refused (key not trusted)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def random_router_id() -> int:
    """A random non-zero u64 process id, as 1.6.1 generates one per process."""
    return secrets.randbits(64) or 1


def validate_endpoint(text: str) -> str | None:
    """None if ``text`` is a peer endpoint 1.6.1 would accept, else its exact error message."""
    problem = _endpoint_problem(text)
    return None if problem is None else f"invalid ZMQ endpoint `{text}`: {problem}"


def _endpoint_problem(text: str) -> str | None:
    scheme, separator, address = text.partition("://")
    if not separator:
        return "missing scheme"
    if scheme not in _SCHEMES:
        return f"unsupported scheme `{scheme}`"
    if not address:
        return "missing address"
    if scheme != "tcp":
        return None
    host, separator, port = address.rpartition(":")
    if not separator:
        return "missing TCP port"
    if not host:
        return "missing TCP host"
    if host.startswith("["):
        if not host.endswith("]"):
            return "missing closing `]`"
    elif ":" in host:
        return "missing TCP port"  # an unbracketed IPv6 address (or a stray colon) is ambiguous
    return _port_problem(port)


def _port_problem(port: str) -> str | None:
    """Rust's ``u16::from_str`` verdict, worded as 1.6.1 reports it."""
    if not port:
        return "invalid TCP port: cannot parse integer from empty string"
    digits = port[1:] if port.startswith("+") else port
    if not digits or not all("0" <= c <= "9" for c in digits):
        return "invalid TCP port: invalid digit found in string"
    if int(digits) > 65535:
        return "invalid TCP port: number too large to fit in target type"
    return None


class Replicator:
    """Replica sync for one ActorSystem: a PUB on ``tcp://{host}:{port}`` and a SUB per peer.

    ``port=0`` binds an ephemeral port (kvrouter's extension, for tests); ``run`` reports the bound
    endpoint through ``task_status``. Peers may be added and removed while running. ``security``
    adds CURVE (every peer must hold a trusted key, and prove it) and sets the per-peer limits.
    """

    def __init__(
        self,
        system: ActorSystem,
        *,
        port: int,
        peers: Sequence[str],
        router_id: int,
        host: str = "0.0.0.0",
        outbox_size: int = OUTBOX_SIZE,
        hwm: int = REPLICA_HWM,
        security: ReplicaSecurity | None = None,
        session_ttl_ns: int = 0,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"replica sync port {port} is not in 0..=65535")
        if not 0 < router_id < 1 << 64:
            raise ValueError("router_id must be a non-zero unsigned 64-bit integer")
        for endpoint in peers:
            if validate_endpoint(endpoint) is not None:
                raise ValueError(f"invalid replica peer endpoint `{endpoint}`")  # 1.6.1's startup error
        if outbox_size <= 0:
            raise ValueError("the outbox must hold at least one message")
        self._system = system
        self._port = port
        self._host = host
        self._hwm = hwm
        self._security = security = security if security is not None else ReplicaSecurity()
        self.router_id = router_id
        # > 0: session bindings are subscribed to and applied with this TTL (the selection service's affinity)
        self.session_ttl_ns = session_ttl_ns
        self.endpoint: str | None = None  # the PUB's bound endpoint, once running
        self.stats = ReplicaStats()
        # endpoint -> its link and the cancel scope of its task (both None while not running)
        self._peers: dict[str, tuple[PeerLink, trio.CancelScope] | None] = {}
        for endpoint in dict.fromkeys(peers):
            self._check_room(endpoint)
            self._server_key(endpoint)
            self._peers[endpoint] = None
        self._outbox_send, self._outbox_receive = trio.open_memory_channel[list[bytes]](outbox_size)
        # request id -> (rank, lora) per scope: a free's event names only the request, but the wire
        # (and a 1.6.1 receiver, which ignores a free naming the wrong rank) needs its rank.
        self._requests: dict[ScopeKey, dict[str, tuple[WorkerRank, str | None]]] = {}
        self._inflight_adds: dict[ScopeKey, dict[str, None]] = {}
        self._drops_logged: set[tuple[str, str]] = set()  # (peer, reason) already logged once
        self._refusals = RefusalLog(f"replica sync (router_id {router_id})")
        self._nursery: trio.Nursery | None = None
        self._ran = False

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        assert not self._ran, "a Replicator runs once"
        self._ran = True
        curve = self._security.curve
        with contextlib.ExitStack() as stack:
            options: dict[int, int | bytes] = {}
            if curve is not None:
                # The ZAP handler must answer before the PUB accepts anyone: without one, libzmq lets
                # any CURVE client in.
                domain = f"kvrouter.replica.{self.router_id}"
                stack.enter_context(zap_domain(domain, curve.trusted, self._refused))
                options = {
                    zmq.CURVE_SERVER: 1,
                    zmq.CURVE_SECRETKEY: curve.identity.secret_key,
                    zmq.ZAP_DOMAIN: domain.encode(),
                }
            pub = stack.enter_context(open_socket(zmq.PUB, sndhwm=self._hwm, rcvhwm=self._hwm, options=options))
            pub.socket.bind(f"tcp://{self._host}:{self._port or '*'}")
            endpoint = self.endpoint = pub.socket.getsockopt_string(zmq.LAST_ENDPOINT)
            # Connect every configured peer before anything runs: one zmq refuses fails startup, as in
            # 1.6.1, with a plain exception rather than one wrapped by a nursery.
            links: list[PeerLink] = []
            try:
                for peer in self._peers:
                    links.append(self._connect(peer))
            except BaseException:
                for link in links:
                    link.close()
                raise
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    for link in links:
                        self._spawn(link)
                    self._seed_requests()
                    self._system.observers.append(self._observe)
                    nursery.start_soon(self._drain, pub)
                    self._log_start()
                    task_status.started(endpoint)
            finally:
                self._nursery = None
                if self._observe in self._system.observers:
                    self._system.observers.remove(self._observe)
                self._peers = dict.fromkeys(self._peers)

    def _log_start(self) -> None:
        curve = self._security.curve
        limits = self._security.limits
        if curve is None:
            mode = "plain (no CURVE: peers are not authenticated and traffic is readable)"
            if self._host not in _LOOPBACK_HOSTS:
                log.warning(
                    "replica sync on %s without CURVE: anyone who reaches this port reads every request id, and "
                    "peers are not authenticated; see README 'Replica sync security'",
                    self.endpoint,
                )
        else:
            mode = f"CURVE, key {curve.identity.public_key.decode()}, {len(curve.trusted.keys)} trusted peer keys"
        log.info(
            "replica sync on %s (router_id %d, %s), peers %s; per peer at most %d bytes a message and %g messages/s, "
            "%d peers at most",
            self.endpoint,
            self.router_id,
            mode,
            self.peers(),
            limits.max_message_bytes,
            limits.rate,
            limits.max_peers,
        )

    # -- peers ------------------------------------------------------------------------------------

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def peer_stats(self) -> dict[str, LinkStats]:
        """Per running peer link: what it received, dropped for rate, and how its connection went."""
        return {endpoint: entry[0].stats for endpoint, entry in sorted(self._peers.items()) if entry is not None}

    def register_peer(self, endpoint: str) -> bool:
        """True if newly added (a SUB starts at once when running), False if already present.

        Raises ValueError with 1.6.1's message for an invalid endpoint or one zmq refuses (and, with
        CURVE, for an endpoint no trusted certificate names); PeerLimitError beyond ``max_peers``.
        """
        problem = validate_endpoint(endpoint)
        if problem is not None:
            raise ValueError(problem)
        if endpoint in self._peers:
            return False
        self._check_room(endpoint)
        if self._nursery is not None:
            self._spawn(self._connect(endpoint))
        else:
            self._server_key(endpoint)
        self._peers.setdefault(endpoint, None)
        return True

    def deregister_peer(self, endpoint: str) -> bool:
        """False if ``endpoint`` is not a peer. Raises ValueError for an invalid endpoint (1.6.1 does)."""
        problem = validate_endpoint(endpoint)
        if problem is not None:
            raise ValueError(problem)
        if endpoint not in self._peers:
            return False
        entry = self._peers.pop(endpoint)
        if entry is not None:
            entry[1].cancel()  # the link's task closes its sockets on the way out
        return True

    def _check_room(self, endpoint: str) -> None:
        cap = self._security.limits.max_peers
        if len(self._peers) >= cap:
            raise PeerLimitError(
                f"cannot add replica peer `{endpoint}`: {len(self._peers)} of at most {cap} peers are registered "
                "(--replica-max-peers); deregister one first"
            )

    def _server_key(self, endpoint: str) -> bytes | None:
        """With CURVE, the key the peer at ``endpoint`` must prove; ValueError if no certificate names it."""
        curve = self._security.curve
        if curve is None:
            return None
        key = curve.trusted.server_key_for(endpoint)
        if key is None:
            raise ValueError(
                f"no trusted certificate names replica peer `{endpoint}`: put its public certificate, with "
                f'`endpoint = "{endpoint}"` in its metadata, in {curve.trusted.directory}'
            )
        return key

    def _connect(self, endpoint: str) -> PeerLink:
        """A connected link, created by the caller so that an endpoint zmq refuses fails the caller."""
        server_key = self._server_key(endpoint)
        curve = self._security.curve
        client = None
        if curve is not None and server_key is not None:
            client = CurveClient(curve.identity.public_key, curve.identity.secret_key, server_key)
        try:
            topics = (TOPIC, AFFINITY_TOPIC) if self.session_ttl_ns > 0 else (TOPIC,)
            return PeerLink.open(endpoint, topics, self._security.limits, self._hwm, client)
        except zmq.ZMQError as error:
            log.warning("replica peer %s refused by zmq: %s", endpoint, error)
            raise ValueError(f"failed to register replica peer `{endpoint}`") from None

    def _spawn(self, link: PeerLink) -> None:
        """Hand ``link`` to its own task, which owns (and closes) it from now on."""
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._peers[link.endpoint] = (link, scope)
        self._nursery.start_soon(self._subscribe, link, scope)

    def _refused(self, key: bytes) -> None:
        """ZAP thread: a subscriber's key is not trusted."""
        self.stats.refused_subscribers += 1
        self._refusals(key)

    # -- outbound ---------------------------------------------------------------------------------

    def _observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        """Called by the actor right after it applied a decision: never blocks, never raises.

        An exception here would strand the actor between its journal append and its reply, so a bug in
        replication costs one message (logged and counted), never the scope.
        """
        try:
            self._publish_decision(state, command, events)
        except Exception:
            log.exception("replica publication failed for %s", state.scope.describe())
            self.stats.unpublishable += 1

    def _publish_decision(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        index = self._requests.setdefault(state.scope, {})
        local = not getattr(command, "remote", False) and not isinstance(command, BindSession)
        lora_name, expected_output = _origin_details(command)
        prune = False
        for event in events:
            if isinstance(event, RequestAdded):
                rank = WorkerRank(event.worker_id, event.dp_rank)
                index[event.request_id] = (rank, lora_name)
                inflight = self._inflight_adds.get(state.scope)
                if inflight is not None:
                    inflight.pop(event.request_id, None)
                if local:
                    tokens = event.prefill_tokens
                    data: EventData = AddRequestData(
                        token_sequence=event.sequence_hashes,
                        track_prefill_tokens=tokens > 0,
                        expected_output_tokens=expected_output,
                        prefill_load_hint=PrefillLoadHint(tokens) if tokens > 0 else None,
                    )
                    self._offer(state, event.request_id, rank, data, lora_name)
            elif isinstance(event, PrefillCompleted | RequestFreed):
                entry = index.get(event.request_id)
                if isinstance(event, RequestFreed):
                    index.pop(event.request_id, None)
                if not local:
                    continue
                if entry is None:
                    self.stats.unpublishable += 1
                    continue
                data = MarkPrefillCompleted() if isinstance(event, PrefillCompleted) else Free()
                self._offer(state, event.request_id, entry[0], data, entry[1])
            elif isinstance(event, RequestsExpired):
                for request_id in event.request_ids:
                    index.pop(request_id, None)
            elif isinstance(event, SessionBound | SessionReleased) and local:
                self._offer_binding(state, event.session_id)
            elif isinstance(event, WorkerUnregistered | WorkerRemoved | WorkerUpserted):
                prune = True  # these take a worker's requests with them
        if not state.exists:
            self._requests.pop(state.scope, None)
            self._inflight_adds.pop(state.scope, None)
        elif prune or len(index) > 2 * len(state.requests) + 1024:
            # The size check is a safety net against request-removing events this module does not know.
            self._requests[state.scope] = {rid: entry for rid, entry in index.items() if rid in state.requests}

    def _offer(
        self, state: ScopeState, request_id: str, rank: WorkerRank, data: EventData, lora_name: str | None
    ) -> None:
        if state.block_size is None:
            self.stats.unpublishable += 1
            return
        message = ReplicaEvent(
            model_name=state.scope.model_name,
            routing_group=state.scope.tenant_id,
            block_size=state.block_size,
            request_id=request_id,
            worker_id=rank.worker_id,
            dp_rank=rank.dp_rank,
            data=data,
            router_id=self.router_id,
            lora_name=lora_name,
        )
        try:
            self._outbox_send.send_nowait(encode(message))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.stats.outbox_dropped += 1  # policy: drop newest (see OUTBOX_SIZE)

    def _offer_binding(self, state: ScopeState, session_id: str) -> None:
        """Publish the session's binding as it now stands (the observer runs after the events were applied)."""
        binding = state.selection.sessions.get(session_id)
        if binding is None:
            return
        message = SessionAffinity(
            model_name=state.scope.model_name,
            routing_group=state.scope.tenant_id,
            session_id=session_id,
            worker_id=binding.worker_id,
            dp_rank=binding.dp_rank,
            sequence=binding.sequence,
            writer_id=binding.writer_id,
        )
        try:
            self._outbox_send.send_nowait(encode_affinity(message))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.stats.outbox_dropped += 1  # policy: drop newest (see OUTBOX_SIZE)

    def _seed_requests(self) -> None:
        """Requests already active when replication starts (recovered from the journal): their frees
        must still name the right rank."""
        for state in self._system.states():
            index = self._requests.setdefault(state.scope, {})
            for request_id, request in state.requests.items():
                index.setdefault(request_id, (request.rank, None))

    async def _drain(self, pub: TrioZmqSocket) -> None:
        while True:
            frames = await self._outbox_receive.receive()
            await pub.send_multipart(frames)  # a PUB never waits: it drops at SNDHWM
            self.stats.published += 1

    def outbox_statistics(self) -> trio.MemoryChannelStatistics:
        return self._outbox_receive.statistics()

    # -- inbound ----------------------------------------------------------------------------------

    async def _subscribe(self, link: PeerLink, scope: trio.CancelScope) -> None:
        with scope:
            await link.run(lambda frames: self._receive(frames, link.endpoint), self._rate_limited)

    def _rate_limited(self) -> None:
        self.stats.received += 1
        self.stats.drop(DropReason.RATE_LIMITED)  # the link logs it, once per peer

    async def _receive(self, frames: list[bytes], peer: str = "") -> None:
        """Apply one peer message, or drop it (1.6.1's rules, plus ids this replica does not know).
        Waiting in ``submit`` blocks this peer's reader (policy: block; zmq's RCVHWM then makes the
        publisher drop)."""
        stats = self.stats
        stats.received += 1
        try:
            event = decode_message(frames)
        except ReplicaWireError as error:
            self._drop(DropReason.MALFORMED, peer, str(error))
            return
        if isinstance(event, SessionAffinity):
            await self._receive_binding(event, peer)
            return
        reason = self._drop_reason(event)
        if reason is not None:
            self._drop(reason, peer, f"request {event.request_id!r} on rank {event.rank} of {event.scope.describe()}")
            return
        command = self._command(event)
        if isinstance(command, AddRequest):
            self._note_inflight_add(event.scope, event.request_id)
        await self._system.submit(event.scope, command)
        stats.applied += 1

    async def _receive_binding(self, binding: SessionAffinity, peer: str) -> None:
        command, reason = self._bind_command(binding)
        if command is None:
            self._drop(reason, peer, f"session {binding.session_id!r} of {binding.scope.describe()}")
            return
        await self._system.submit(binding.scope, command)
        self.stats.applied += 1

    def _bind_command(self, binding: SessionAffinity) -> tuple[BindSession | None, str]:
        """The command applying a peer's binding, or None and why it is dropped."""
        if self.session_ttl_ns <= 0:
            return None, DropReason.AFFINITY_DISABLED
        if binding.writer_id == self.router_id:
            return None, DropReason.OWN_ROUTER
        if text_too_long(binding.session_id):
            return None, DropReason.OVER_LIMIT
        state = self._system.state(binding.scope)
        if state is None:
            return None, DropReason.UNKNOWN_SCOPE
        ranks = sorted(rank.dp_rank for rank in state.ranks if rank.worker_id == binding.worker_id)
        # A binding without a rank (1.6.1's nil) takes the worker's first rank; replica traffic never creates workers.
        dp_rank = binding.dp_rank if binding.dp_rank is not None else (ranks[0] if ranks else None)
        if dp_rank is None or dp_rank not in ranks:
            return None, DropReason.UNREGISTERED_RANK
        at = self._system.clock.now_ns()  # the receiver's clock, as for requests
        command = BindSession(
            binding.session_id, binding.worker_id, dp_rank, binding.sequence, binding.writer_id, self.session_ttl_ns, at
        )
        return command, ""

    # -- without sockets: a transport the caller owns (kvrouter's simulations carry the frames) -----

    def start_without_sockets(self) -> None:
        """Observe local decisions as ``run`` does, but bind and connect nothing: what would be
        published waits in the outbox for ``take_published``, and peers' messages come in through
        ``receive``. Instead of ``run``, never with it."""
        assert not self._ran, "a Replicator runs once"
        self._ran = True
        self._seed_requests()
        self._system.observers.append(self._observe)

    def take_published(self) -> list[list[bytes]]:
        """Every message published since the last call, in publication order (the PUB task's share)."""
        published = []
        while True:
            try:
                published.append(self._outbox_receive.receive_nowait())
            except trio.WouldBlock:
                return published

    async def receive(self, frames: list[bytes], peer: str = "") -> None:
        """One message from a peer, decoded, filtered and applied exactly as a SUB task applies it."""
        await self._receive(frames, peer)

    def _drop(self, reason: str, peer: str, detail: str) -> None:
        """Count a dropped message; the first of each kind from each peer is logged at warning."""
        self.stats.drop(reason)
        if len(detail) > 300:  # a peer chooses the ids: the log line stays short
            detail = detail[:300] + "..."
        if (peer, reason) in self._drops_logged:
            log.debug("replica message from %s dropped (%s): %s", peer, reason, detail)
            return
        self._drops_logged.add((peer, reason))
        log.warning(
            "replica message from %s dropped (%s): %s; further drops of this kind from it are only counted",
            peer or "a peer",
            reason,
            detail,
        )

    def _drop_reason(self, event: ReplicaEvent) -> str | None:
        if event.router_id == self.router_id:
            return DropReason.OWN_ROUTER
        if text_too_long(event.request_id):
            return DropReason.OVER_LIMIT  # a peer may not store what a client could not
        state = self._system.state(event.scope)
        if state is None:
            return DropReason.UNKNOWN_SCOPE
        if state.block_size != event.block_size:
            return DropReason.BLOCK_SIZE_MISMATCH
        if event.rank not in state.ranks:
            return DropReason.UNREGISTERED_RANK  # replica traffic never creates workers
        if not isinstance(event.data, AddRequestData):
            known = event.request_id in state.requests or event.request_id in self._inflight_adds.get(event.scope, ())
            if not known:
                return DropReason.UNKNOWN_REQUEST
        return None

    def _note_inflight_add(self, scope: ScopeKey, request_id: str) -> None:
        pending = self._inflight_adds.setdefault(scope, {})
        pending[request_id] = None
        if len(pending) > INFLIGHT_ADDS_PER_SCOPE:  # policy: forget the oldest
            del pending[next(iter(pending))]

    def _command(self, event: ReplicaEvent) -> Command:
        at = self._system.clock.now_ns()  # the receiver's clock, as in 1.6.1
        data = event.data
        if isinstance(data, AddRequestData):
            return AddRequest(
                event.request_id,
                event.worker_id,
                event.dp_rank,
                data.token_sequence or (),
                data.prefill_tokens,
                at=at,
                remote=True,
            )
        if isinstance(data, MarkPrefillCompleted):
            return CompletePrefill(event.request_id, at=at, remote=True)
        # FreeRequest, not ReleaseReservation: an unknown request is a silent no-op, in the selection service too.
        return FreeRequest(event.request_id, at=at, remote=True)


def _origin_details(command: Command) -> tuple[str | None, int | None]:
    """(lora_name, expected_output_tokens) that 1.6.1's selection service puts on the wire."""
    if isinstance(command, SelectWorker):
        return command.prompt.lora_name, command.options.expected_output_tokens
    return None, None
