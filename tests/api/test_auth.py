"""Bearer-token authentication: every route but GET /health needs the token; it is never logged.

The service runs on real hypercorn on 127.0.0.1; the token file's rules are checked directly.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.api.http.auth import BearerToken, TokenFileError
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, slot_tracker_app
from tests.api.test_http_front import WEBSOCKET_UPGRADE
from tests.support.raw_http import exchange, request_bytes

TOKEN = "s3cret-Token_with.chars~"
GOOD = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def guarded(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[ServiceHandle]:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", auth=BearerToken(TOKEN.encode()))
    handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
    yield handle
    handle.stop()


def test_the_token_matches_only_itself_under_the_bearer_scheme() -> None:
    token = BearerToken(b"abc")
    assert token.admits(b"Bearer abc") and token.admits(b"bearer abc") and token.admits(b"BEARER  abc ")
    for wrong in (None, b"", b"Bearer", b"Bearer ab", b"Bearer abcd", b"Basic abc", b"abc", b"Bearer ABC"):
        assert not token.admits(wrong), wrong
    assert "abc" not in repr(token)


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (None, "cannot be read"),
        (b"", "is empty"),
        (b" \n", "is empty"),
        (b"two words", "spaces"),
        (b"\xc3\xbc", "non-ASCII"),
    ],
)
def test_an_unusable_token_file_is_one_line(tmp_path: Path, content: bytes | None, complaint: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenFileError, match=complaint) as refused:
        BearerToken.from_file(path)
    assert "\n" not in str(refused.value)


def test_a_trailing_newline_is_not_part_of_the_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(TOKEN.encode() + b"\n")
    assert BearerToken.from_file(path).admits(f"Bearer {TOKEN}".encode())


async def test_every_route_but_health_requires_the_token(guarded: ServiceHandle) -> None:
    async with httpx.AsyncClient(base_url=guarded.urls[0]) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.head("/health")).status_code == 200
        for method, path in [
            ("GET", "/loads"),
            ("GET", "/workers"),
            ("POST", "/register"),
            ("GET", "/replica_sync/peers"),
            ("POST", "/replica_sync/register_peer"),
            ("GET", "/nowhere"),  # 401, not 404: an unauthenticated client learns nothing about routes
            ("POST", "/health"),
        ]:
            missing = await http.request(method, path, json={})
            assert missing.status_code == 401, (method, path)
            assert missing.json() == {
                "error": "this route requires a bearer token: send `Authorization: Bearer <token>`"
            }
            assert missing.headers["www-authenticate"] == 'Bearer realm="kvrouter"'
            wrong = await http.request(method, path, json={}, headers={"authorization": "Bearer nope"})
            assert (wrong.status_code, wrong.json()) == (401, {"error": "the bearer token is not valid"})
            assert wrong.headers["www-authenticate"] == 'Bearer realm="kvrouter", error="invalid_token"'
        assert (await http.get("/loads", headers=GOOD)).status_code == 200
        assert (await http.get("/replica_sync/peers", headers=GOOD)).json() == []
        body = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert (await http.post("/register", json=body)).status_code == 401
        assert (await http.get("/workers", headers=GOOD)).json() == []  # the refused write changed nothing
        assert (await http.post("/register", json=body, headers=GOOD)).status_code == 201


async def test_a_refused_body_closes_the_connection_and_a_websocket_gets_401(guarded: ServiceHandle) -> None:
    url = guarded.urls[0]
    refused = await exchange(url, request_bytes("POST", "/register", b"{}", {"content-type": "application/json"}))
    assert refused.status == 401 and refused.closes
    upgrade = await exchange(url, request_bytes("GET", "/loads", headers=WEBSOCKET_UPGRADE))
    assert upgrade.status == 401 and set(upgrade.json()) == {"error"}  # type: ignore[arg-type]


async def test_one_debug_line_per_request_and_never_the_token(
    guarded: ServiceHandle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=guarded.urls[0]) as http:
        await http.get("/loads?model_name=m", headers=GOOD)
        await http.get("/re%2Fgister", headers={"authorization": "Bearer wrong-token"})
        await http.post("/register", json={}, headers=GOOD)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvrouter.api.requests"]
    assert [line.rsplit(" ", 2)[0] for line in lines] == [
        "GET /loads 200",
        "GET /re%2Fgister 401",
        "POST /register 422",
    ]
    assert all(line.endswith(" ms") for line in lines)
    everything = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert TOKEN not in everything and "wrong-token" not in everything
