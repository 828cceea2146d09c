"""The listener budget: its arithmetic, the slots the service reserves, and the real costs behind the
numbers (sockets and descriptors per listener, the context's socket limit, descriptor exhaustion)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import trio

from kvrouter.actors.kv_listener import KvListener
from kvrouter.actors.transport import socket_budget
from kvrouter.actors.transport.socket_budget import (
    FD_RESERVE,
    FD_TARGET,
    FDS_PER_LISTENER,
    FDS_PER_REPLAY,
    MAX_CONCURRENT_REPLAYS,
    OTHER_ZMQ_SOCKETS,
    SOCKETS_PER_LISTENER,
    SUPPORTED_RANKS,
    ZMQ_MAX_SOCKETS,
    ListenerCapacityError,
    ListenerSlots,
    listener_capacity,
)
from tests.support.kv_publisher import open_kv_publisher, sample_payload

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (process-wide limits stay out of this one); it prints JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_supported_cluster_fits_the_numbers() -> None:
    fds_needed = SUPPORTED_RANKS * FDS_PER_LISTENER + MAX_CONCURRENT_REPLAYS * FDS_PER_REPLAY + FD_RESERVE
    assert fds_needed == 17_152
    assert listener_capacity(fds_needed) == SUPPORTED_RANKS
    assert listener_capacity(fds_needed - 1) == SUPPORTED_RANKS - 1
    assert fds_needed <= FD_TARGET
    assert ZMQ_MAX_SOCKETS >= SUPPORTED_RANKS * SOCKETS_PER_LISTENER + MAX_CONCURRENT_REPLAYS + OTHER_ZMQ_SOCKETS
    assert listener_capacity(1_024) == 64  # the usual default soft limit, before raising it
    assert listener_capacity(20_000) == 4_808
    assert listener_capacity(1 << 40) == 5_333  # then zmq sockets are the bound
    assert listener_capacity(100) == 0


def test_slots_refuse_beyond_capacity_all_or_nothing() -> None:
    slots = ListenerSlots(3, "limited by the open-files limit 1024; raise it")
    assert slots.reserve([(1, 0), (1, 1)]) == [(1, 0), (1, 1)]
    assert slots.reserve([(1, 0), (1, 1)]) == []  # a re-registration holds its slots already
    with pytest.raises(ListenerCapacityError) as refused:
        slots.reserve([(1, 1), (2, 0), (2, 1)])
    assert str(refused.value) == (
        "cannot listen to 2 more KV event stream(s): 2 of 3 KV listener slots are in use, "
        "limited by the open-files limit 1024; raise it"
    )
    assert (slots.in_use, slots.holds((2, 0))) == (2, False)  # nothing was taken
    assert slots.reserve([(2, 0)]) == [(2, 0)]
    assert slots.available == 0
    slots.release([(1, 0), (9, 9)])
    slots.release([(1, 0)])
    assert (slots.in_use, slots.available) == (2, 1)
    assert slots.reserve([(2, 1)]) == [(2, 1)]


def test_slots_for_this_process_raise_the_limit_and_name_it() -> None:
    result = run_python(
        """
        import json, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        from kvrouter.actors.transport.socket_budget import ListenerSlots, raise_open_files_limit
        slots = ListenerSlots.for_this_process()
        after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        lowered = raise_open_files_limit(target=100)
        print(json.dumps({"hard": hard, "after": after, "capacity": slots.capacity, "limited_by": slots.limited_by,
                          "kept": [lowered.soft_before, lowered.soft]}))
        """
    )
    hard = int(str(result["hard"]))
    assert result["after"] == min(hard, FD_TARGET)
    assert result["capacity"] == listener_capacity(min(hard, FD_TARGET))
    assert result["kept"] == [result["after"], result["after"]]  # never lowers it
    limited_by = str(result["limited_by"])
    if listener_capacity(min(hard, FD_TARGET)) < listener_capacity(1 << 40):
        assert limited_by.startswith(f"limited by the open-files limit {result['after']} (hard {hard}")
    else:
        assert limited_by.startswith(f"limited by ZMQ_MAX_SOCKETS {ZMQ_MAX_SOCKETS}")


def test_the_context_holds_more_sockets_than_libzmqs_default() -> None:
    """libzmq's default of 1,023 sockets was the ~340-rank ceiling."""
    result = run_python(
        """
        import json, zmq
        from kvrouter.actors.transport.socket_budget import raise_open_files_limit
        from kvrouter.actors.transport.zmq_socket import open_socket
        limit = raise_open_files_limit()
        wanted = 1_500
        sockets = []
        if limit.soft > wanted + 100:
            sockets = [open_socket(zmq.SUB) for _ in range(wanted)]
        print(json.dumps({"opened": len(sockets), "soft": limit.soft}))
        for sock in sockets:
            sock.close()
        """
    )
    if result["opened"] == 0:
        pytest.skip(f"the hard open-files limit here ({result['soft']}) is below 1,600")
    assert result["opened"] == 1_500


def open_fds_by_kind() -> Counter[str]:
    """Descriptors of this process: "eventfd" (every libzmq socket owns one, including the monitor's
    internal PAIR that pyzmq never sees), "socket" (TCP connections), "other"."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listdir's own descriptor is gone already
            target = os.readlink(f"/proc/self/fd/{fd}")
            kinds["eventfd" if target == "anon_inode:[eventfd]" else target.split(":")[0]] += 1
    return kinds


async def test_a_connected_listener_costs_what_the_budget_says() -> None:
    """Measured against a publisher in another process, so only the listeners' side is counted."""
    count = 20
    publisher_code = """
        import sys, zmq
        pub = zmq.Context.instance().socket(zmq.XPUB)
        print(pub.bind_to_random_port("tcp://127.0.0.1"), flush=True)
        sys.stdin.read()
    """

    async def discard(group: list[tuple[int, bytes]]) -> None:
        pass

    async def start_active(nursery: trio.Nursery, port: int, how_many: int) -> None:
        listeners = [KvListener(f"tcp://127.0.0.1:{port}", None, discard) for _ in range(how_many)]
        for listener in listeners:
            await nursery.start(listener.run)
        while any(listener.status.state != "active" for listener in listeners):  # noqa: ASYNC110
            await trio.sleep(0.01)

    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", textwrap.dedent(publisher_code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        with trio.fail_after(10):
            port = int((await process.stdout.receive_some()).decode())
            async with trio.open_nursery() as nursery:
                await start_active(nursery, port, 1)  # the process's first listener sets up zmq internals
                before = open_fds_by_kind()
                await start_active(nursery, port, count)
                cost = open_fds_by_kind() - before
                nursery.cancel_scope.cancel()
    finally:
        process.kill()
        await process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                await pipe.aclose()
    print(f"\n{count} connected listeners: {dict(cost)} descriptors")
    assert cost == Counter({"eventfd": count * SOCKETS_PER_LISTENER, "socket": count})
    assert cost.total() == count * FDS_PER_LISTENER


def test_out_of_descriptors_fails_the_listener_not_the_process() -> None:
    """What a registration beyond the budget used to do to the service (an unhandled ZMQError)."""
    result = run_python(
        """
        import json, resource, trio
        from kvrouter.actors.kv_listener import KvListener

        async def discard(group):
            pass

        async def main():
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            states = []
            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    status = await nursery.start(KvListener("tcp://127.0.0.1:9", None, discard).run)
                    states.append((status.state, status.last_error))
                    if status.state == "failed":
                        break
                nursery.cancel_scope.cancel()
            return states

        states = trio.run(main)
        print(json.dumps({"states": states}))
        """
    )
    states = result["states"]
    assert isinstance(states, list) and len(states) > 1
    assert all(state == ["connecting", None] for state in states[:-1])
    assert states[-1][0] == "failed"
    assert states[-1][1].startswith("cannot open a zmq socket: Too many open files")


async def test_replays_take_turns_under_the_process_wide_limit(nursery: trio.Nursery) -> None:
    """Two listeners hit a gap at once and both replay endpoints stay silent. With one permit, the
    second request can reach its publisher only after the first replay gave up (and counted its
    loss, which happens before the permit is handed on); without the limit both ask at once."""
    socket_budget._REPLAY_LIMITER.set(trio.CapacityLimiter(1))  # this test's trio run only

    async def discard(group: list[tuple[int, bytes]]) -> None:
        pass

    with trio.fail_after(10):
        async with (
            open_kv_publisher(drop_live=[1], answer_replays=False) as first,
            open_kv_publisher(drop_live=[1], answer_replays=False) as second,
        ):
            publishers = (first, second)
            listeners = [
                KvListener(pub.endpoint, pub.replay_endpoint, discard, catch_up_on_connect=False, replay_timeout=0.3)
                for pub in publishers
            ]
            for pub, listener in zip(publishers, listeners, strict=True):
                await nursery.start(listener.run)
                await pub.wait_for_subscribers()
            for pub in publishers:
                for seq in range(3):
                    pub.publish(sample_payload(seq))
            while not (first.replay_requests and second.replay_requests):  # noqa: ASYNC110
                await trio.sleep(0.002)
            lost_when_both_had_asked = sum(listener.status.lost_batches for listener in listeners)
    assert (first.replay_requests, second.replay_requests) == ([1], [1])
    assert lost_when_both_had_asked == 1
