"""Against Dynamo 1.6.1 itself (optional): the tokenizer checksum a live ``dynamo.mocker`` writes in its model card
(``v1/mdc/...``) is what kvrouter computes for the same ``tokenizer.json`` (``"blake3:<hex>"``), so a frontend
started with ``--model-path`` on the mocker's directory reports no mismatch; a mocker started on a copy whose
``tokenizer.json`` differs is reported (log line, ``GET /workers``'s ``tokenizer``, ``/metrics``).

Real processes on free loopback ports, stopped by their PID: etcd, nats-server (the mocker's runtime needs NATS),
``kvrouter frontend`` and ``python -m dynamo.mocker`` from the throw-away Dynamo venv (skipped when it is absent:
``tests/support/dynamo_venv.py``). The mocker's event plane is NATS: a ZMQ publisher would bind 0.0.0.0."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvrouter.actors.fleet.tokenizer_check import local_checksum
from tests.fleet.dynamo_stack import MAKE_MODEL
from tests.support.dynamo_venv import dynamo_python
from tests.support.fleet_servers import EtcdServer, NatsServer, require_etcd, require_nats
from tests.support.processes import free_port, start_process

pytestmark = pytest.mark.slow

WAIT = 120  # the mocker's first start loads its Python packages


async def eventually(check: Callable[[], Awaitable[Any]]) -> Any:
    with trio.fail_after(WAIT):
        while True:
            found = await check()
            if found:
                return found
            await trio.sleep(0.2)


def make_models(python: str, directory: Path) -> tuple[Path, Path]:
    """The mocker's model directory (no weights, a small BPE tokenizer) and a copy with one more added token."""
    same, changed = directory / "model", directory / "changed"
    subprocess.run([python, "-c", MAKE_MODEL, str(same)], check=True, capture_output=True, timeout=120)
    shutil.copytree(same, changed)
    tokenizer = json.loads((changed / "tokenizer.json").read_text())
    extra = {"id": 400, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False}
    tokenizer["added_tokens"].append({**extra, "normalized": False, "special": True})
    (changed / "tokenizer.json").write_text(json.dumps(tokenizer))
    return same, changed


class Mocker:
    """``python -m dynamo.mocker`` on ``model``, everything on loopback; stopped (clean: keys deleted) by PID."""

    def __init__(self, python: str, etcd: EtcdServer, nats: NatsServer, log: Path) -> None:
        self._argv = [python, "-m", "dynamo.mocker", "--model-name", "tiny", "--block-size", "16"]
        self._argv += ["--num-gpu-blocks-override", "1024", "--discovery-backend", "etcd", "--request-plane", "tcp"]
        self._argv += ["--event-plane", "nats"]
        self._env = {
            **os.environ,
            "ETCD_ENDPOINTS": etcd.url,
            "NATS_SERVER": nats.url,
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
        }
        self._log = log
        self.process: trio.Process | None = None

    async def start(self, model: Path) -> None:
        with self._log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [*self._argv, "--model-path", str(model)], stdout=log, stderr=log, env=self._env
            )

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def card_checksums(etcd: EtcdServer) -> list[str]:
    """The ``tokenizer.hf_tokenizer_json.checksum`` of every model card in etcd, as Dynamo wrote it."""
    found = await etcd.call(
        "/v3/kv/range",
        {"key": base64.b64encode(b"v1/mdc/").decode(), "range_end": base64.b64encode(b"v1/mdc0").decode()},
    )
    cards = [json.loads(base64.b64decode(kv["value"]))["card_json"] for kv in found.get("kvs", [])]
    return [card["tokenizer"]["hf_tokenizer_json"]["checksum"] for card in cards]


@pytest.fixture
def dynamo() -> str:
    return dynamo_python()


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[tuple[EtcdServer, NatsServer]]:
    require_etcd()
    require_nats()
    etcd, nats = EtcdServer(tmp_path), NatsServer(tmp_path, jetstream=False)
    await etcd.start()
    try:
        await nats.start()
        try:
            yield etcd, nats
        finally:
            await nats.stop()
    finally:
        await etcd.stop()


async def test_a_dynamo_cards_tokenizer_checksum_is_kvrouters(
    tmp_path: Path, dynamo: str, servers: tuple[EtcdServer, NatsServer]
) -> None:
    python, (etcd, nats) = dynamo, servers
    same, changed = make_models(python, tmp_path)
    port = free_port()
    fleet = ["--discovery-backend", "etcd", "--etcd-endpoints", etcd.url]
    fleet += ["--event-plane", "nats", "--nats-server", nats.url]
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "frontend", "--port", str(port), "--model-path", str(same)]
    frontend = await start_process([*argv, *fleet], port, tmp_path / "frontend.log")
    mocker = Mocker(python, etcd, nats, tmp_path / "mocker.log")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:

            async def checked() -> dict[str, Any]:
                rows = (await http.get("/workers")).json()
                return rows[0]["tokenizer"] if rows and rows[0].get("tokenizer") else {}

            await mocker.start(same)
            verdict = await eventually(checked)
            assert await card_checksums(etcd) == [local_checksum(same / "tokenizer.json")]  # the card's format
            assert verdict == {
                "card_checksum": local_checksum(same / "tokenizer.json"),
                "local_checksum": local_checksum(same / "tokenizer.json"),
                "matches": True,
            }
            await mocker.stop()  # a clean stop deletes its keys

            async def gone() -> bool:
                return (await http.get("/workers")).json() == []

            await eventually(gone)
            await mocker.start(changed)
            verdict = await eventually(checked)
            assert await card_checksums(etcd) == [local_checksum(changed / "tokenizer.json")]
            assert verdict["card_checksum"] == local_checksum(changed / "tokenizer.json") != verdict["local_checksum"]
            assert verdict["matches"] is False
            metrics = (await http.get("/metrics")).text
            assert "kvrouter_tokenizer_mismatched_workers 1.0" in metrics
            assert "kvrouter_tokenizer_mismatches_reported_total 1.0" in metrics
        assert "its model card's tokenizer is " + verdict["card_checksum"] in (tmp_path / "frontend.log").read_text()
    finally:
        await mocker.stop()
        frontend.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await frontend.wait()
        if frontend.returncode is None:
            frontend.kill()
            await frontend.wait()
