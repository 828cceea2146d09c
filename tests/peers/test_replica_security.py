"""Replica peers as an attacker would try them: no key, a wrong key, eavesdropping, floods, oversized
messages, forged ids. Real ZMQ sockets on 127.0.0.1 and the real clock, as test_replicator.py.

Every negative check ("not heard") is anchored on something observable first: a refused handshake
counted by the side that refused it, or a positive control sent after the forged traffic on the same
path, so nothing relies on sleeping and hoping.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import zmq

from kvrouter.actors.core.commands import AddRequest, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.peers.curve import (
    CurveConfigError,
    TrustedPeers,
    load_identity,
    write_certificates,
)
from kvrouter.actors.peers.peer_limits import PeerLimits, TokenBucket
from kvrouter.actors.peers.replica_wire import (
    TOPIC,
    AddRequestData,
    Free,
    MarkPrefillCompleted,
    PrefillLoadHint,
    ReplicaEvent,
    encode,
)
from kvrouter.actors.peers.replicator import (
    CurveSettings,
    DropReason,
    PeerLimitError,
    ReplicaSecurity,
    Replicator,
)
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.journal.memory import MemoryJournal
from tests.peers.test_replicator import SCOPE, WORKER, eventually, running, within

FAST_RECONNECT = 0.05


class Keys:
    """Certificates for named replicas, in one directory per replica that trusts them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "all"

    def make(self, name: str, endpoint: str = "") -> tuple[Path, Path]:
        return write_certificates(self.store, name, [endpoint] if endpoint else [])

    def trust_dir(self, owner: str, *names: str) -> Path:
        directory = self.root / f"trusted-by-{owner}"
        directory.mkdir(exist_ok=True)
        for name in names:
            (directory / f"{name}.key").write_bytes((self.store / f"{name}.key").read_bytes())
        return directory

    def curve(self, name: str, trusted: Path) -> CurveSettings:
        return CurveSettings(load_identity(self.store / f"{name}.key_secret"), TrustedPeers(trusted))

    def pair(self, name: str) -> tuple[bytes, bytes]:
        identity = load_identity(self.store / f"{name}.key_secret")
        return identity.public_key, identity.secret_key


async def start_system(nursery: trio.Nursery) -> tuple[ActorSystem, MemoryJournal]:
    journal = MemoryJournal()
    system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
    await nursery.start(journal.run)
    await nursery.start(system.run)
    await system.ask(SCOPE, RegisterWorker(WORKER, block_size=16, dp_start=0, dp_size=2))
    return system, journal


async def start_replicator(
    nursery: trio.Nursery,
    system: ActorSystem,
    *,
    router_id: int,
    port: int = 0,
    peers: tuple[str, ...] = (),
    security: ReplicaSecurity | None = None,
) -> Replicator:
    replicator = Replicator(system, port=port, peers=peers, router_id=router_id, host="127.0.0.1", security=security)
    await nursery.start(replicator.run)
    return replicator


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def add(
    request_id: str, *, worker_id: int = WORKER, dp_rank: int = 0, router_id: int = 50, model: str = "m"
) -> list[bytes]:
    data = AddRequestData((1, 2), True, None, PrefillLoadHint(4))
    return encode(ReplicaEvent(model, "g", 16, request_id, worker_id, dp_rank, data, router_id))


def free(request_id: str, *, dp_rank: int = 0) -> list[bytes]:
    return encode(ReplicaEvent("m", "g", 16, request_id, WORKER, dp_rank, Free(), 50))


def requests(system: ActorSystem) -> set[str]:
    state = system.state(SCOPE)
    return set(state.requests) if state is not None else set()


@asynccontextmanager
async def raw_publisher(
    *, curve_server: tuple[bytes, bytes] | None = None, port: int | None = None
) -> AsyncIterator[tuple[TrioZmqSocket, str]]:
    """An XPUB (reports subscriptions), optionally a CURVE server with the given (public, secret) keys.

    A CURVE one gets a context of its own: the replicator's ZAP handler serves the process-wide context,
    and would judge this stand-in's subscribers too (a real peer is another process)."""
    options: dict[int, int | bytes] = {}
    context: zmq.Context[zmq.Socket[bytes]] | None = None
    if curve_server is not None:
        options = {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: curve_server[1]}
        context = zmq.Context()
    try:
        with open_socket(zmq.XPUB, options=options, context=context) as xpub:
            if port is None:
                port = xpub.socket.bind_to_random_port("tcp://127.0.0.1")
            else:
                xpub.socket.bind(f"tcp://127.0.0.1:{port}")
            yield xpub, f"tcp://127.0.0.1:{port}"
    finally:
        if context is not None:
            context.term()


async def subscribed(xpub: TrioZmqSocket) -> None:
    """Until a SUB subscribes (skipping the unsubscription a dropped connection leaves)."""
    while (frames := await xpub.recv_multipart()) != [b"\x01" + TOPIC]:
        assert frames == [b"\x00" + TOPIC]


async def prove(source: ActorSystem, target: ActorSystem) -> None:
    """Retry a probe admission on ``source`` until ``target`` applies it (the SUB is live), then free them."""
    probes = []
    for attempt in range(1000):
        probes.append(f"probe-{id(source)}-{attempt}")
        await source.ask(SCOPE, AddRequest(probes[-1], WORKER, 0, (), 0))
        if await within(0.2, lambda: probes[-1] in requests(target)):
            break
    for request_id in probes:
        await source.ask(SCOPE, FreeRequest(request_id))
    await eventually(lambda: not any(r.startswith("probe-") for r in requests(target)))


# -- CURVE: authentication and encryption -----------------------------------------------------------


async def test_curve_replicas_sync_with_each_other(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    port_a, port_b = free_port(), free_port()
    end_a, end_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    keys.make("a", end_a)
    keys.make("b", end_b)
    async with running() as nursery:
        system_a, _ = await start_system(nursery)
        system_b, _ = await start_system(nursery)
        security_a = ReplicaSecurity(keys.curve("a", keys.trust_dir("a", "b")))
        security_b = ReplicaSecurity(keys.curve("b", keys.trust_dir("b", "a")))
        a = await start_replicator(nursery, system_a, router_id=1, port=port_a, peers=(end_b,), security=security_a)
        b = await start_replicator(nursery, system_b, router_id=2, port=port_b, peers=(end_a,), security=security_b)
        await prove(system_a, system_b)
        await prove(system_b, system_a)
        await system_a.ask(SCOPE, AddRequest("r1", WORKER, 1, (1, 2, 3), 12))
        await eventually(lambda: "r1" in requests(system_b))
        assert a.stats.refused_subscribers == b.stats.refused_subscribers == 0
        assert all(stats.handshake_failures == 0 for stats in a.peer_stats().values())


async def test_a_peer_without_the_trusted_key_is_not_heard(tmp_path: Path) -> None:
    """Our SUB requires the key of the certificate naming the endpoint: a publisher there without that
    secret key (an impostor with its own key, or one without CURVE) completes no handshake."""
    keys = Keys(tmp_path)
    impostor_port, plain_port, real_port = free_port(), free_port(), free_port()
    impostor, plain, real = (f"tcp://127.0.0.1:{p}" for p in (impostor_port, plain_port, real_port))
    keys.make("b")
    keys.make("trusted-1", impostor)  # the certificate the operator trusts for that endpoint ...
    keys.make("attacker")  # ... but the process listening there holds another key
    keys.make("trusted-2", plain)
    keys.make("trusted-3", real)
    trusted = keys.trust_dir("b", "trusted-1", "trusted-2", "trusted-3")
    async with (
        running() as nursery,
        raw_publisher(curve_server=keys.pair("attacker"), port=impostor_port) as (fake, _),
        raw_publisher(port=plain_port) as (unencrypted, _),
        raw_publisher(curve_server=keys.pair("trusted-3"), port=real_port) as (genuine, _),
    ):
        system, _ = await start_system(nursery)
        security = ReplicaSecurity(keys.curve("b", trusted))
        replicator = await start_replicator(
            nursery, system, router_id=2, peers=(impostor, plain, real), security=security
        )
        links = replicator.peer_stats()
        await eventually(lambda: links[impostor].handshake_failures >= 1 and links[plain].handshake_failures >= 1)
        await subscribed(genuine)
        for frames in (add("forged-1"), free("r-victim")):
            assert fake.try_send_multipart(frames) and unencrypted.try_send_multipart(frames)
        await genuine.send_multipart(add("genuine"))
        await eventually(lambda: "genuine" in requests(system))
        assert requests(system) == {"genuine"}
        assert links[impostor].received == links[plain].received == 0
        assert links[impostor].connections == links[plain].connections == 0
        assert replicator.stats.received == 1


async def test_an_unauthenticated_subscriber_reads_nothing(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    keys.make("b")
    keys.make("friend")
    keys.make("stranger")
    async with running() as nursery:
        system, _ = await start_system(nursery)
        security = ReplicaSecurity(keys.curve("b", keys.trust_dir("b", "friend")))
        replicator = await start_replicator(nursery, system, router_id=2, security=security)
        assert replicator.endpoint is not None
        b_public = load_identity(keys.store / "b.key_secret").public_key

        def subscriber(name: str | None) -> TrioZmqSocket:
            options: dict[int, int | bytes] = {zmq.SUBSCRIBE: TOPIC}
            if name is not None:
                public, secret = keys.pair(name)
                options |= {zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret, zmq.CURVE_SERVERKEY: b_public}
            sub = open_socket(zmq.SUB, options=options)
            sub.socket.connect(replicator.endpoint or "")
            return sub

        with subscriber("stranger") as stranger, subscriber(None) as plain, subscriber("friend") as friend:
            await eventually(lambda: replicator.stats.refused_subscribers >= 1)  # the stranger, by ZAP
            heard = False
            for attempt in range(1000):  # until the trusted subscriber hears what we publish
                await system.ask(SCOPE, AddRequest(f"secret-{attempt}", WORKER, 0, (), 0))
                with trio.move_on_after(0.2):
                    await friend.recv_multipart()
                    heard = True
                if heard:
                    break
            assert heard
            assert stranger.try_recv_multipart() is None
            assert plain.try_recv_multipart() is None


async def test_unknown_subscriber_key_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = Keys(tmp_path)
    keys.make("b")
    keys.make("stranger")
    caplog.set_level(logging.WARNING, logger="kvrouter.replica")
    async with running() as nursery:
        system, _ = await start_system(nursery)
        replicator = await start_replicator(
            nursery, system, router_id=2, security=ReplicaSecurity(keys.curve("b", keys.trust_dir("b")))
        )
        b_public = load_identity(keys.store / "b.key_secret").public_key
        public, secret = keys.pair("stranger")
        for _ in range(3):
            options: dict[int, int | bytes] = {
                zmq.SUBSCRIBE: TOPIC,
                zmq.CURVE_PUBLICKEY: public,
                zmq.CURVE_SECRETKEY: secret,
                zmq.CURVE_SERVERKEY: b_public,
            }
            with open_socket(zmq.SUB, options=options) as sub:
                count = replicator.stats.refused_subscribers
                sub.socket.connect(replicator.endpoint or "")
                await eventually(lambda c=count: replicator.stats.refused_subscribers > c)  # type: ignore[misc]
    refusals = [r for r in caplog.records if "refused a subscriber" in r.getMessage()]
    assert len(refusals) == 1 and public.decode() in refusals[0].getMessage()


async def test_a_certificate_added_later_is_trusted_without_restart(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    keys.make("b")
    port = free_port()
    late = f"tcp://127.0.0.1:{port}"
    keys.make("late", late)
    trusted = keys.trust_dir("b")
    async with running() as nursery:
        system, _ = await start_system(nursery)
        replicator = await start_replicator(
            nursery, system, router_id=2, security=ReplicaSecurity(keys.curve("b", trusted))
        )
        with pytest.raises(ValueError, match="no trusted certificate names replica peer"):
            replicator.register_peer(late)
        keys.trust_dir("b", "late")
        async with raw_publisher(curve_server=keys.pair("late"), port=port) as (xpub, _):
            assert replicator.register_peer(late) is True
            await subscribed(xpub)
            await xpub.send_multipart(add("from-late"))
            await eventually(lambda: "from-late" in requests(system))


def test_key_files_are_checked(tmp_path: Path) -> None:
    public, secret = write_certificates(tmp_path / "keys", "r1", ["tcp://10.0.0.1:5555", "tcp://r1:5555"])
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    identity = load_identity(secret)
    assert identity.warnings == ()
    trusted = TrustedPeers(tmp_path / "keys")
    assert trusted.server_key_for("tcp://r1:5555") == identity.public_key
    assert trusted.server_key_for("tcp://10.0.0.1:5555") == identity.public_key
    assert trusted.allows(identity.public_key) and not trusted.allows(b"x" * 40)
    with pytest.raises(FileExistsError):
        write_certificates(tmp_path / "keys", "r1", [])
    with pytest.raises(CurveConfigError, match="holds no secret key"):
        load_identity(public)
    with pytest.raises(CurveConfigError, match="cannot read a certificate"):
        load_identity(tmp_path / "missing.key_secret")
    with pytest.raises(CurveConfigError, match="cannot list it"):
        TrustedPeers(tmp_path / "missing")
    secret.chmod(0o644)
    assert load_identity(secret).warnings == (
        f"--replica-curve-secret-key-file {secret} is readable by other users: chmod 600 it",
    )
    (tmp_path / "keys" / "broken.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(CurveConfigError, match=r"broken\.key: the public key is not 40 characters"):
        TrustedPeers(tmp_path / "keys")


def test_two_certificates_for_one_endpoint_are_refused(tmp_path: Path) -> None:
    write_certificates(tmp_path, "one", ["tcp://h:1"])
    write_certificates(tmp_path, "two", ["tcp://h:1"])
    with pytest.raises(CurveConfigError, match="two certificates name the endpoint tcp://h:1"):
        TrustedPeers(tmp_path)


# -- limits -----------------------------------------------------------------------------------------


async def test_peer_count_is_capped() -> None:
    async with running() as nursery:
        system, _ = await start_system(nursery)
        with pytest.raises(PeerLimitError, match=r"2 of at most 2 peers"):
            Replicator(
                system,
                port=0,
                peers=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"),
                router_id=1,
                security=ReplicaSecurity(limits=PeerLimits(max_peers=2)),
            )
        replicator = await start_replicator(
            nursery, system, router_id=2, security=ReplicaSecurity(limits=PeerLimits(max_peers=2))
        )
        assert replicator.register_peer("tcp://127.0.0.1:1") is True
        assert replicator.register_peer("tcp://127.0.0.1:2") is True
        assert replicator.register_peer("tcp://127.0.0.1:2") is False  # known: not a new peer
        with pytest.raises(PeerLimitError, match=r"^cannot add replica peer `tcp://127.0.0.1:3`: 2 of at most 2"):
            replicator.register_peer("tcp://127.0.0.1:3")
        assert replicator.peers() == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        assert replicator.deregister_peer("tcp://127.0.0.1:1")
        assert replicator.register_peer("tcp://127.0.0.1:3") is True


async def test_an_oversized_message_is_refused_and_the_peer_heard_again_after() -> None:
    limits = PeerLimits(max_message_bytes=1024)
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, _ = await start_system(nursery)
        replicator = Replicator(
            system, port=0, peers=(endpoint,), router_id=2, host="127.0.0.1", security=ReplicaSecurity(limits=limits)
        )
        await nursery.start(replicator.run)
        link = replicator.peer_stats()[endpoint]
        await subscribed(xpub)
        big = encode(
            ReplicaEvent("m", "g", 16, "big", WORKER, 0, AddRequestData(tuple(range(2**40, 2**40 + 200)), False), 50)
        )  # 200 hashes: over 1 KiB
        assert len(big[1]) > 1024
        await xpub.send_multipart(big)
        await eventually(lambda: link.disconnects >= 1)  # libzmq dropped the connection on the big frame
        await subscribed(xpub)  # the link reconnected by itself
        await xpub.send_multipart(add("small"))
        await eventually(lambda: "small" in requests(system))
        assert "big" not in requests(system)
        assert link.reconnects >= 1


async def test_a_flooding_peer_is_rate_limited() -> None:
    limits = PeerLimits(rate=50.0, burst=5)
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, _ = await start_system(nursery)
        replicator = await start_replicator(
            nursery, system, router_id=2, peers=(endpoint,), security=ReplicaSecurity(limits=limits)
        )
        link = replicator.peer_stats()[endpoint]
        await subscribed(xpub)
        started = trio.current_time()
        for i in range(40):
            await xpub.send_multipart(add(f"flood-{i}"))
        await eventually(lambda: link.received == 40)
        elapsed = trio.current_time() - started
        applied = replicator.stats.applied
        assert link.rate_limited == 40 - applied > 0
        assert replicator.stats.dropped[DropReason.RATE_LIMITED] == link.rate_limited
        assert applied <= 5 + 50 * elapsed + 1  # the burst, then the rate
        await eventually(lambda: len(requests(system)) == applied)


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=10.0, size=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, False]
    assert bucket.wait_time(0.0) == pytest.approx(0.1)
    assert bucket.take(0.1) and not bucket.take(0.1)
    assert bucket.take(10.0) and bucket.take(10.0) and not bucket.take(10.0)  # never above its size


def test_limits_are_checked() -> None:
    for bad in ({"max_peers": 81}, {"max_message_bytes": 10}, {"rate": 0.0}, {"burst": 0.5}):
        with pytest.raises(ValueError):
            PeerLimits(**bad)  # type: ignore[arg-type]
    assert PeerLimits(rate=300.0).bucket_size == 300.0


# -- forged ids -------------------------------------------------------------------------------------


async def test_forged_unknown_ids_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvrouter.replica")
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, journal = await start_system(nursery)
        await system.ask(SCOPE, AddRequest("victim", WORKER, 1, (9,), 7))
        replicator = await start_replicator(nursery, system, router_id=2, peers=(endpoint,))
        await subscribed(xpub)
        state = system.state(SCOPE)
        assert state is not None
        loads_before = {rank: (r.prefill_tokens, r.active_decode_blocks) for rank, r in state.ranks.items()}
        records = journal.last_lsn
        forged = [
            free("no-such-request"),
            free("no-such-request-2"),
            encode(ReplicaEvent("m", "g", 16, "no-such-request", WORKER, 0, MarkPrefillCompleted(), 50)),
            free("victim", dp_rank=5),  # the right id on a rank that does not exist
            add("phantom", worker_id=999),  # a worker that is not registered
            add("phantom-2", dp_rank=7),
            add("phantom-3", model="no-such-model"),
            add("x" * 5000),  # an id longer than the HTTP API accepts (4,096 bytes)
        ]
        for frames in forged:
            await xpub.send_multipart(frames)
        # Positive control on the same path, after the forged messages: an admission immediately
        # followed by its free (the free may arrive before the admission is applied: still known).
        await xpub.send_multipart(add("control"))
        await xpub.send_multipart(free("control"))
        await eventually(lambda: replicator.stats.received == len(forged) + 2)
        await eventually(lambda: journal.last_lsn == records + 2)  # the control's add and free, nothing else
        # ``applied`` counts once submit() returns, which can be a scheduling turn after the journal wrote.
        await eventually(lambda: replicator.stats.applied == 2)
        assert requests(system) == {"victim"}
        assert {rank: (r.prefill_tokens, r.active_decode_blocks) for rank, r in state.ranks.items()} == loads_before
        assert replicator.stats.dropped == {
            DropReason.UNKNOWN_REQUEST: 3,
            DropReason.UNREGISTERED_RANK: 3,
            DropReason.UNKNOWN_SCOPE: 1,
            DropReason.OVER_LIMIT: 1,
        }
        assert replicator.stats.applied == 2
    unknown = [r for r in caplog.records if "(unknown_request)" in r.getMessage()]
    assert len(unknown) == 1  # logged once, counted three times
    assert all(r.levelno == logging.WARNING for r in unknown)
    assert WorkerRank(WORKER, 1) in state.ranks


# -- through the service: routes, flags, key generation ---------------------------------------------


async def test_register_peer_route_answers_409_beyond_the_cap_and_400_without_a_certificate(tmp_path: Path) -> None:
    from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, slot_tracker_app

    keys = Keys(tmp_path)
    keys.make("me")
    keys.make("known", "tcp://127.0.0.1:7001")
    keys.make("other", "tcp://127.0.0.1:7002")
    security = ReplicaSecurity(keys.curve("me", keys.trust_dir("me", "known", "other")), PeerLimits(max_peers=1))
    options = ServiceOptions(
        port=0, data_dir=tmp_path / "data", replica_sync_port=free_port(), replica_security=security
    )
    async with running() as nursery:
        handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
        async with httpx.AsyncClient(base_url=handle.urls[0]) as http:

            async def register(endpoint: str) -> tuple[int, dict[str, str]]:
                response = await http.post("/replica_sync/register_peer", json={"endpoint": endpoint})
                return response.status_code, response.json()

            status, body = await register("tcp://127.0.0.1:7003")
            assert status == 400 and body["error"].startswith("no trusted certificate names replica peer")
            assert await register("tcp://127.0.0.1:7001") == (201, {"status": "ok"})
            status, body = await register("tcp://127.0.0.1:7002")
            assert status == 409
            assert body == {
                "error": "cannot add replica peer `tcp://127.0.0.1:7002`: 1 of at most 1 peers are registered "
                "(--replica-max-peers); deregister one first"
            }
            assert (await http.get("/replica_sync/peers")).json() == ["tcp://127.0.0.1:7001"]
        handle.stop()


def test_security_flags_are_checked(tmp_path: Path) -> None:
    from kvrouter.actors.core.router_config import InvalidSettings
    from kvrouter.api.cli.main import build_parser
    from kvrouter.api.cli.settings import settings_from

    keys = Keys(tmp_path)
    keys.make("me")
    keys.make("peer", "tcp://127.0.0.1:7001")
    trusted = str(keys.trust_dir("me", "peer"))
    secret = str(keys.store / "me.key_secret")

    def launch(*flags: str) -> ReplicaSecurity:
        args = build_parser().parse_args(["slot-tracker", "--data-dir", str(tmp_path / "d"), *flags])
        security = settings_from(args, {}).options.replica_security
        assert security is not None
        return security

    def problems(*flags: str) -> list[str]:
        with pytest.raises(InvalidSettings) as caught:
            launch(*flags)
        return list(caught.value.problems)

    assert launch() == ReplicaSecurity()
    secured = launch(
        "--replica-sync-port",
        "7000",
        "--replica-sync-peers",
        "tcp://127.0.0.1:7001",
        "--replica-curve-secret-key-file",
        secret,
        "--replica-curve-peer-keys-dir",
        trusted,
        "--replica-max-peers",
        "3",
        "--replica-max-message-bytes",
        "65536",
        "--replica-peer-max-rate",
        "500",
    )
    assert secured.curve is not None and secured.curve.trusted.keys == {keys.pair("peer")[0]}
    assert secured.limits == PeerLimits(max_peers=3, max_message_bytes=65536, rate=500.0)
    assert problems("--replica-curve-secret-key-file", secret) == [
        "--replica-curve-secret-key-file and --replica-curve-peer-keys-dir go together: pass both"
    ]
    assert problems("--replica-curve-secret-key-file", secret, "--replica-curve-peer-keys-dir", trusted) == [
        "--replica-curve-secret-key-file requires --replica-sync-port"
    ]
    unknown_peer = problems(
        "--replica-sync-port",
        "7000",
        "--replica-sync-peers",
        "tcp://127.0.0.1:7009",
        "--replica-curve-secret-key-file",
        secret,
        "--replica-curve-peer-keys-dir",
        trusted,
    )
    assert (
        len(unknown_peer) == 1 and "no certificate in" in unknown_peer[0] and "tcp://127.0.0.1:7009" in unknown_peer[0]
    )
    assert problems(
        "--replica-max-peers", "81", "--replica-max-message-bytes", "x", "--replica-peer-max-rate", "0"
    ) == [
        "--replica-max-peers='81' must be between 0 and 80",
        "--replica-max-message-bytes='x' is not a whole number",
        "--replica-peer-max-rate='0' must be between 1 and 10000000",
    ]
    assert problems(
        "--replica-sync-port", "7000", "--replica-sync-peers", "tcp://h:1,tcp://h:2", "--replica-max-peers", "1"
    ) == ["--replica-sync-peers lists 2 peers; --replica-max-peers allows 1"]


def test_keys_generate_writes_a_usable_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvrouter.api.cli.main import main

    assert main(["keys", "generate", "--name", "r1", "--dir", str(tmp_path), "--endpoint", "tcp://10.0.0.1:5555"]) == 0
    identity = load_identity(tmp_path / "r1.key_secret")
    assert TrustedPeers(tmp_path).server_key_for("tcp://10.0.0.1:5555") == identity.public_key
    assert main(["keys", "generate", "--name", "r1", "--dir", str(tmp_path)]) == 2
    assert main(["keys", "generate", "--name", "r2", "--dir", str(tmp_path), "--endpoint", "bogus"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kvrouter keys generate: {tmp_path / 'r1.key'} exists; remove it or choose another --name",
        "kvrouter keys generate: invalid ZMQ endpoint `bogus`: missing scheme",
    ]
