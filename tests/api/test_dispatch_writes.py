"""The actor process's dispatcher runs a message's consecutive slot tracker writes as one ``apply_writes`` call:
each call still gets its own answer (a refusal as data, as on its own), applied in the order the front sent
them. Real ZMQ ipc sockets, a front's message built by hand."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.service_support import EVERY_SCOPE, Refused, decode_failure
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.transport.zmq_socket import open_socket
from kvrouter.api.process.fronts import ACTOR_SOCKET, FRONT_SOCKET, ipc, open_dispatcher
from kvrouter.api.process.main import ServiceOptions, recovered_runtime, slot_tracker_objects
from kvrouter.api.process.wire import encode_args, method_table, pack, pack_message, unpack
from kvrouter.journal.store import Durability

A = ScopeKey("a", "default")
B = ScopeKey("b", "t1")
INCARNATION = 12345


def message(calls: list[tuple[str, tuple[Any, ...]]]) -> bytes:
    """One front message holding ``calls`` (method, arguments) of SlotService, ids 0.., in this order."""
    table = method_table(SlotService)
    items = [
        pack([call_id, "service", method, encode_args(table[method], args, {})])
        for call_id, (method, args) in enumerate(calls)
    ]
    return pack_message(0, INCARNATION, items=items)


def answer_of(ok: bool, payload: Any) -> Any:
    if ok:
        return payload
    refused = decode_failure(payload)
    assert isinstance(refused, Refused), payload
    return (refused.reason, refused.message)


async def test_a_message_of_writes_answers_each_call_in_order(tmp_path: Path) -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("free", (B, "before")),  # no scope yet
        ("register", (A, 1, 16, 0, 2)),
        ("add", (B, "r1", 1, 0, (1, 2), 16)),  # no tracker for b yet
        ("register", (B, 1, 16, 0, 1)),
        ("add", (A, "r1", 1, 1, (1, 2, 3), 16)),
        ("add", (A, "r1", 1, 0, (4,), 16)),  # the same id again
        ("add", (B, "r1", 1, 0, (2**64 - 1,), 8)),
        ("prefill_complete", (A, "r1")),
        ("add", (A, "r2", 9, 0, (5,), 16)),  # no worker 9
        ("workers", (EVERY_SCOPE,)),  # not a write: its own task, between two runs of writes
        ("free", (B, "r1")),
        ("register", (A, 1, 16, 0, 2)),  # registered already
    ]
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    replies: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvr-") as runtime_dir:
        async with recovered_runtime("slot tracker", options) as (runtime, _):
            objects = await slot_tracker_objects(options, runtime.system, runtime.nursery)
            dispatcher = open_dispatcher(objects, Path(runtime_dir))
            await runtime.nursery.start(dispatcher.run)
            with open_socket(zmq.PULL) as pull, open_socket(zmq.PUSH) as push:
                pull.socket.bind(ipc(Path(runtime_dir), FRONT_SOCKET.format(0)))
                push.socket.connect(ipc(Path(runtime_dir), ACTOR_SOCKET))
                await push.send_multipart([message(calls)])
                while len(replies) < len(calls):
                    [frame] = await pull.recv_multipart()
                    incarnation, answered = unpack(frame)
                    assert incarnation == INCARNATION
                    replies.update((call_id, answer_of(ok, payload)) for call_id, ok, payload in answered)
            loads = await objects.service.loads()
            runtime.stopping.set()
            runtime.nursery.cancel_scope.cancel()
    assert isinstance(replies.pop(9), list)
    assert [replies[i] for i in sorted(replies)] == [
        (Reason.NOT_FOUND, "no slot tracker for model=b tenant_id=t1"),
        True,
        (Reason.NOT_FOUND, "no slot tracker for model=b tenant_id=t1"),
        True,
        True,
        (
            Reason.CONFLICT,
            "Request r1 already exists (assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 1 })",
        ),
        True,
        False,
        (Reason.NOT_FOUND, "Worker WorkerWithDpRank { worker_id: 9, dp_rank: 0 } not found"),
        False,
        (Reason.CONFLICT, "worker 1 already registered for model=a tenant_id=default"),
    ]
    blocks = {(rows.scope, load.rank.dp_rank): load.active_decode_blocks for rows in loads for load in rows.loads}
    assert blocks == {(A, 0): 0, (A, 1): 3, (B, 0): 0}  # b's r1 freed again


@pytest.mark.parametrize("bad", ["bogus"])
async def test_apply_writes_refuses_a_write_it_does_not_know(tmp_path: Path, bad: str) -> None:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    async with recovered_runtime("slot tracker", options) as (runtime, _):
        service = SlotService(runtime.system)
        with pytest.raises(ValueError, match=f"apply_writes has no write '{bad}'"):
            await service.apply_writes([["free", "a", "default", "r"], [bad, "a", "default"]])
        assert runtime.system.journal.last_lsn == 0  # nothing applied
        runtime.stopping.set()
        runtime.nursery.cancel_scope.cancel()
