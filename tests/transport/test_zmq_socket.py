"""TrioZmqSocket against real sockets on tcp://127.0.0.1 (real clock: autojump would fire the safety
timeouts while the kernel is still moving bytes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket, zmq_context

# A safety timeout this long cannot rescue a lost wakeup within a test's deadline: a test that
# finishes proves the FD edge did the work.
NO_SAFETY_NET = 30.0


@pytest.fixture
def pair_factory() -> Iterator[list[TrioZmqSocket]]:
    """Sockets made by a test are closed here even when it fails (no ResourceWarning noise)."""
    made: list[TrioZmqSocket] = []
    yield made
    for sock in made:
        sock.close()


def _open(made: list[TrioZmqSocket], kind: int, **options: Any) -> TrioZmqSocket:
    sock = open_socket(kind, **options)
    made.append(sock)
    return sock


def _bind(sock: TrioZmqSocket) -> str:
    port = sock.socket.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def test_options_are_explicit(pair_factory: list[TrioZmqSocket]) -> None:
    sock = _open(pair_factory, zmq.DEALER, sndhwm=7, rcvhwm=9, linger_ms=0)
    assert (sock.socket.getsockopt(zmq.SNDHWM), sock.socket.getsockopt(zmq.RCVHWM)) == (7, 9)
    assert sock.socket.getsockopt(zmq.LINGER) == 0
    assert sock.socket.context is zmq_context()


async def test_pub_sub_round_trip(pair_factory: list[TrioZmqSocket]) -> None:
    pub = _open(pair_factory, zmq.XPUB)
    sub = _open(pair_factory, zmq.SUB)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    with trio.fail_after(5):
        sub.socket.connect(_bind(pub))
        assert await pub.recv_multipart() == [b"\x01kv"]  # XPUB sees the subscription: no slow joiner
        await pub.send_multipart([b"other", b"x"])  # filtered out by the subscription
        await pub.send_multipart([b"kv", b"\x00" * 8, b"payload"])
        assert await sub.recv_multipart() == [b"kv", b"\x00" * 8, b"payload"]


async def test_dealer_router_round_trip(pair_factory: list[TrioZmqSocket]) -> None:
    router = _open(pair_factory, zmq.ROUTER)
    dealer = _open(pair_factory, zmq.DEALER)
    with trio.fail_after(5):
        dealer.socket.connect(_bind(router))
        await dealer.send_multipart([b"", b"ping"])
        identity, empty, body = await router.recv_multipart()
        assert (empty, body) == (b"", b"ping")
        await router.send_multipart([identity, b"", b"pong"])
        assert await dealer.recv_multipart() == [b"", b"pong"]


async def test_pub_sub_burst_loses_no_wakeup(pair_factory: list[TrioZmqSocket]) -> None:
    count = 20_000
    pub = _open(pair_factory, zmq.XPUB, sndhwm=count, rcvhwm=10, safety_timeout=NO_SAFETY_NET)
    sub = _open(pair_factory, zmq.SUB, sndhwm=10, rcvhwm=count, safety_timeout=NO_SAFETY_NET)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    received: list[int] = []

    async def consume() -> None:
        while len(received) < count:
            (frame,) = await sub.recv_multipart()
            received.append(int(frame))

    with trio.fail_after(10):
        sub.socket.connect(_bind(pub))
        await pub.recv_multipart()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            for i in range(count):
                await pub.send_multipart([b"%d" % i])
                if i % 1000 == 0:
                    await trio.sleep(0.001)  # let the reader park on the FD mid-burst, many times
    assert received == list(range(count))


async def test_push_pull_backpressure_both_directions(pair_factory: list[TrioZmqSocket]) -> None:
    """Tiny HWMs: the sender waits for POLLOUT and the receiver for POLLIN, over and over."""
    count = 5_000
    push = _open(pair_factory, zmq.PUSH, sndhwm=4, rcvhwm=4, safety_timeout=NO_SAFETY_NET)
    pull = _open(pair_factory, zmq.PULL, sndhwm=4, rcvhwm=4, safety_timeout=NO_SAFETY_NET)
    received: list[int] = []

    async def produce() -> None:
        for i in range(count):
            await push.send_multipart([i.to_bytes(4, "big")])

    with trio.fail_after(10):
        push.socket.connect(_bind(pull))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            while len(received) < count:
                (frame,) = await pull.recv_multipart()
                received.append(int.from_bytes(frame, "big"))
                if len(received) % 500 == 0:
                    await trio.sleep(0.005)  # fill the pipe so the producer has to park
    assert received == list(range(count))


async def test_cancel_while_waiting_leaves_socket_usable(pair_factory: list[TrioZmqSocket]) -> None:
    router = _open(pair_factory, zmq.ROUTER)
    dealer = _open(pair_factory, zmq.DEALER)
    dealer.socket.connect(_bind(router))
    with trio.fail_after(5):
        with trio.move_on_after(0.1) as scope:
            await router.recv_multipart()
        assert scope.cancelled_caught
        await dealer.send_multipart([b"after"])
        assert (await router.recv_multipart())[1:] == [b"after"]


async def test_cancel_is_prompt_even_with_long_safety_timeout(pair_factory: list[TrioZmqSocket]) -> None:
    sub = _open(pair_factory, zmq.SUB, safety_timeout=NO_SAFETY_NET)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    started = trio.current_time()
    with trio.fail_after(5), trio.move_on_after(0.05):
        await sub.recv_multipart()
    assert trio.current_time() - started < 1.0


async def test_close_while_waiting_wakes_the_waiter(pair_factory: list[TrioZmqSocket]) -> None:
    sub = _open(pair_factory, zmq.SUB, safety_timeout=NO_SAFETY_NET)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    outcome: list[str] = []

    async def wait_forever() -> None:
        try:
            await sub.recv_multipart()
        except trio.ClosedResourceError:
            outcome.append("closed")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_forever)
            await trio.testing.wait_all_tasks_blocked()
            sub.close()
    assert outcome == ["closed"]
    assert sub.closed and sub.socket.closed
    sub.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        await sub.recv_multipart()
    with pytest.raises(trio.ClosedResourceError):
        await sub.send_multipart([b"x"])


async def test_try_variants_do_not_wait(pair_factory: list[TrioZmqSocket]) -> None:
    dealer = _open(pair_factory, zmq.DEALER, sndhwm=1)
    assert dealer.try_recv_multipart() is None
    assert dealer.try_send_multipart([b"x"]) is False  # no peer: DEALER would block
    await trio.lowlevel.checkpoint()


async def test_queued_messages_keep_their_frame_counts(pair_factory: list[TrioZmqSocket]) -> None:
    """Messages of 1, 4 and 3 frames queued back to back come out exactly as sent: the read stops at each
    message's last frame (a reader that assumed 3 frames would splice the next message's frames in)."""
    pub = _open(pair_factory, zmq.XPUB)
    sub = _open(pair_factory, zmq.SUB)
    sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
    sent = [[b"lone"], [b"", b"\x00" * 8, b"payload", b"extra"], [b"", b"\x00" * 7 + b"\x01", b"p" * 5000], [b""]]
    with trio.fail_after(5):
        sub.socket.connect(_bind(pub))
        assert await pub.recv_multipart() == [b"\x01"]
        for message in sent:
            await pub.send_multipart(message)
        received = [await sub.recv_multipart()]  # waits for the first; the rest are queued behind it
        while len(received) < len(sent):
            frames = sub.try_recv_multipart()
            if frames is None:
                await trio.sleep(0.01)
                continue
            received.append(frames)
    assert received == sent
    assert all(type(frame) is bytes for message in received for frame in message)
    assert sub.try_recv_multipart() is None
