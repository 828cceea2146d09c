"""The ``kvrouter-forwarded`` marker is honoured only from a member of the cluster (``api/routes/forwarded.py``).

It names the sending replica (its advertise URL). A client that sends it anyway, with any other value, gets 400
``{"error": ...}`` naming the header from every route that reads it (the gathered reads, the writes, ``POST
/batch``), and nothing is applied; a replica whose forward is refused that way tells its own client 503, not
applied. On real processes (etcd, a nats-server with JetStream, two slot-tracker replicas sharing an
``--auth-token-file``, on free loopback ports, stopped by PID), and without servers for the sender's side.
"""

from __future__ import annotations

import httpx
import pytest

from kvrouter.actors.cluster.forwarder import Forwarder, OwnerUnreachable
from kvrouter.actors.core.ownership.forwarding import FORWARD_REFUSED_HEADER, FORWARDED_HEADER
from tests.support.cluster import model_owned_by, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.replicas import AUTH, Replica, pair

__all__ = ["etcd_and_nats", "pair", "servers"]  # fixtures (tests/support)


@pytest.mark.slow
async def test_a_client_sending_the_forwarded_marker_gets_400_and_nothing_is_applied(pair: list[Replica]) -> None:
    a, b = pair
    model = model_owned_by(a.url, [a.url, b.url])
    register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    add = {"model_name": model, "request_id": "r1", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}
    async with (
        httpx.AsyncClient(base_url=b.url, timeout=15, trust_env=False, headers=AUTH) as to_b,
        httpx.AsyncClient(base_url=b.url, timeout=15, trust_env=False) as stranger,
    ):
        await wait_for_members(to_b, 2)
        assert (await to_b.post("/register", json=register)).status_code == 201  # B forwards it to A: honoured
        requests = [
            ("GET", "/loads", None),
            ("GET", "/workers", None),
            ("POST", "/add", add),
            ("POST", "/batch", [{"method": "POST", "path": "/add", "body": add}]),
        ]
        for method, path, body in requests:
            refused = await to_b.request(method, path, json=body, headers={FORWARDED_HEADER: "1"})
            assert refused.status_code == 400, (path, refused.text)
            assert FORWARDED_HEADER in refused.json()["error"] and "'1'" in refused.json()["error"], refused.text
        for value in ("http://127.0.0.1:1", b.url, f"{a.url}, {a.url}"):  # no member, B itself, two values
            refused = await to_b.get("/loads", headers={FORWARDED_HEADER: value})
            assert refused.status_code == 400 and FORWARDED_HEADER in refused.json()["error"], (value, refused.text)
        # Without the token, the token is what is missing (the marker is no way around it).
        assert (await stranger.get("/loads", headers={FORWARDED_HEADER: a.url})).status_code == 401
        loads = (await to_b.get("/loads", params={"model_name": model})).json()
    # the refused /add and /batch changed nothing
    assert [(row["active_prefill_tokens"], row["active_decode_blocks"]) for row in loads] == [(0, 0)], loads
    assert [row["worker_id"] for row in loads] == [1]  # and the read without the marker has A's rows


class _Owner:
    """An owner answering every forward as ``status`` (with the refusal header if ``refused``), noting what came."""

    def __init__(self, status: int, refused: bool) -> None:
        self.status, self.refused = status, refused
        self.markers: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.markers.append(request.headers.get(FORWARDED_HEADER))
        headers = {FORWARD_REFUSED_HEADER: "1"} if self.refused else {}
        return httpx.Response(self.status, json={"error": "names no member"}, headers=headers)


async def test_the_sender_names_itself_and_a_refused_forward_is_not_applied() -> None:
    refusing = _Owner(400, refused=True)
    forwarder = Forwarder(5.0, "http://10.0.0.1:8091")
    forwarder._client = httpx.AsyncClient(transport=httpx.MockTransport(refusing))
    with pytest.raises(OwnerUnreachable) as raised:
        await forwarder.relay("http://10.0.0.2:8091", "POST", "/add", b"", b"{}")
    assert refusing.markers == ["http://10.0.0.1:8091"]
    assert not raised.value.unknown and "refused the forward from http://10.0.0.1:8091" in str(raised.value)
    # A 400 of the route itself (a bad body) is the owner's answer, passed back as it is.
    answering = _Owner(400, refused=False)
    forwarder._client = httpx.AsyncClient(transport=httpx.MockTransport(answering))
    relayed = await forwarder.relay("http://10.0.0.2:8091", "POST", "/add", b"", b"{}")
    assert relayed.status == 400
    await forwarder.aclose()
