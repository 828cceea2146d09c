"""Discovery from a watched file (no etcd): the selection service and the frontend keep their catalog equal to a
JSON or YAML list of workers; a file that cannot be read keeps the last catalog and says why; the fleet flags take
Dynamo's spellings and environment, and a bad one is one line and exit 2."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.fleet.worker_file import read_worker_file
from kvrouter.actors.kv_ingest import IN_PROCESS_KV_EVENTS
from kvrouter.actors.select_service import SelectService
from kvrouter.api.cli.main import build_parser, main
from kvrouter.api.cli.settings import settings_from
from kvrouter.api.frontend.cli import main as frontend_main
from kvrouter.api.frontend.options import FrontendOptions
from kvrouter.api.frontend.service import FrontendHandle, run_frontend
from kvrouter.api.process.main import (
    ServiceHandle,
    ServiceOptions,
    run_service,
    select_objects_builder,
    select_service_builder,
    select_service_routes_of,
)
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.proxied import run_proxied_service

WAIT = 30


def write(path: Path, text: str) -> None:
    """Replace the file whole (a new inode), as an editor or a config-management tool does."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds; fail after ``WAIT`` seconds (a bound on a hang, not a timing assertion)."""
    with trio.fail_after(WAIT):
        while True:
            if await check():
                return
            await trio.sleep(0.05)


async def worker_ids(http: httpx.AsyncClient) -> set[int]:
    return {row["worker_id"] for row in (await http.get("/workers")).json()}


YAML_TWO = """\
- worker_id: 1
  model_name: m
  endpoint: http://127.0.0.1:9001
  block_size: 16
- worker_id: 2
  model_name: m
  endpoint: http://127.0.0.1:9002
  block_size: 16
"""


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_the_selection_service_follows_a_yaml_file(nursery: trio.Nursery, tmp_path: Path, layout: str) -> None:
    """In both process layouts: with ``--fronts``, discovery runs in the actor process and the fronts read its
    status over the service wire."""
    listing = tmp_path / "workers.yaml"
    write(listing, YAML_TWO)
    options = ServiceOptions(
        port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS, body_limit=SELECTION_BODY_LIMIT
    )
    fleet = FleetOptions(discovery_backend="file", discovery_file=listing)
    config = RouterConfig(use_kv_events=False)
    handle: ServiceHandle
    if layout == "proxied":
        build_objects = select_objects_builder(config, fleet=fleet)
        proxied = partial(
            run_proxied_service, "selection service", options, build_objects, select_service_routes_of, SelectService
        )
        handle = await nursery.start(proxied)
    else:
        handle = await nursery.start(
            run_service, "selection service", options, select_service_builder(config, fleet=fleet)
        )
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        rows = (await http.get("/workers")).json()
        assert [(row["worker_id"], row["discovered_by"]) for row in rows] == [(1, "file"), (2, "file")]
        write(
            listing,
            YAML_TWO.split("- worker_id: 2")[0]
            + "- {worker_id: 3, model_name: m, endpoint: http://h:3, block_size: 16}\n",
        )

        async def changed() -> bool:
            return await worker_ids(http) == {1, 3}

        await eventually(changed)
        write(listing, "- worker_id: [not, a, number]\n")

        async def invalid() -> bool:
            return (await http.get("/ready")).json()["discovery"]["state"] == "invalid"

        await eventually(invalid)
        ready = (await http.get("/ready")).json()
        assert "entry 0" in ready["discovery"]["last_error"]
        assert await worker_ids(http) == {1, 3}  # the last catalog stays
        assert (await http.delete("/workers/1")).status_code == 409
        write(listing, "[]\n")

        async def emptied() -> bool:
            return await worker_ids(http) == set()

        await eventually(emptied)
        assert (await http.get("/ready")).json()["discovery"]["state"] == "synced"
    handle.stop()


async def test_the_frontend_follows_a_json_file(nursery: trio.Nursery, tmp_path: Path) -> None:
    listing = tmp_path / "workers.json"
    write(listing, orjson.dumps([{"endpoint": "http://127.0.0.1:9101"}]).decode())
    options = FrontendOptions(
        port=0, model_name="mock", block_size=32, fleet=FleetOptions(discovery_backend="file", discovery_file=listing)
    )
    handle: FrontendHandle = await nursery.start(run_frontend, options)
    async with httpx.AsyncClient(base_url=handle.url, timeout=10) as http:
        (row,) = (await http.get("/workers")).json()
        # the frontend's model and block size, and no KV events: scored on its bookings, like --workers
        assert (row["model_name"], row["block_size"], row["discovered_by"]) == ("mock", 32, "file")
        assert row["kv_events_endpoint"] == IN_PROCESS_KV_EVENTS
        assert row["lifecycle"] == "schedulable"
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "mock"
    handle.stop()


def fleet_of(*argv: str, env: dict[str, str] | None = None) -> FleetOptions:
    args = build_parser().parse_args(["select-service", *argv])
    return settings_from(args, env or {}).fleet


def test_the_fleet_flags_take_dynamos_spellings_and_environment(tmp_path: Path) -> None:
    assert not fleet_of().enabled
    env = {
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": "127.0.0.1:2379,http://10.0.0.2:2379",
        "DYN_NAMESPACE": "prod",
        "DYN_EVENT_PLANE": "nats",
        "NATS_SERVER": "nats://127.0.0.1:4222",
    }
    fleet = fleet_of(env=env)
    assert (fleet.discovery_backend, fleet.namespace, fleet.event_plane) == ("etcd", "prod", "nats")
    assert fleet.etcd_endpoints == ("http://127.0.0.1:2379", "http://10.0.0.2:2379")
    assert fleet.nats_servers == ("nats://127.0.0.1:4222",)
    flags = fleet_of("--discovery-backend", "etcd", "--namespace", "dynamo", "--event-plane", "zmq", env=env)
    assert (flags.namespace, flags.event_plane) == ("dynamo", "zmq")  # a flag wins over its variable
    assert fleet_of("--discovery-backend", "etcd").event_plane == "zmq"  # Dynamo's default with etcd
    assert fleet_of("--discovery-backend", "etcd", "--no-jetstream").jetstream.enabled is False


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--discovery-backend", "kubernetes"], "Kubernetes discovery is not supported yet"),
        (["--discovery-backend", "consul"], "is not one of etcd, file"),
        (["--discovery-backend", "file"], "needs --discovery-file"),
        (["--discovery-backend", "file", "--discovery-file", "/nonexistent/w.yaml"], "No such file"),
        (["--discovery-backend", "etcd", "--event-plane", "kafka"], "is not one of nats, zmq"),
        (["--discovery-backend", "etcd", "--namespace", "a.b"], "--namespace='a.b' must be"),
        (["--discovery-backend", "etcd", "--jetstream-max-bytes", "12"], "--jetstream-max-bytes='12' must be"),
    ],
)
def test_a_bad_fleet_flag_is_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    assert main(["select-service", "--data-dir", str(tmp_path / "d"), *argv]) == 2
    (record,) = caplog.records
    assert problem in record.getMessage()


def test_the_frontend_takes_the_same_flags(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert frontend_main(["--discovery-backend", "k8s"]) == 2
    (record,) = caplog.records
    assert "Kubernetes discovery is not supported yet" in record.getMessage()


def test_a_file_that_is_not_yaml_is_refused_in_one_line_naming_where(tmp_path: Path) -> None:
    # PyYAML's own message quotes the source over several lines; the operator gets one, with the line and column.
    path = tmp_path / "fleet.yaml"
    write(path, "workers:\n  - id: 1\n   bad: [\n")
    with pytest.raises(ValueError) as refused:
        read_worker_file(path, lambda bodies: [])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{path} is not YAML: ") and "at line 3, column 4" in message
