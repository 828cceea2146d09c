"""A Dynamo 1.6.1 launch line for ``kvrouter frontend``, ``select-service`` and ``slot-tracker``: Dynamo's flag names
and environment map to the kvrouter setting of the same job, a flag without effect says so in one warning line, and an
unknown flag is one line naming the nearest valid one (docs/fleet.md, Dynamo's flags and environment)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvrouter.actors.core.router_config import InvalidSettings
from kvrouter.api.cli.main import build_parser as service_parser
from kvrouter.api.cli.main import main as kvrouter_main
from kvrouter.api.cli.main import parse_arguments
from kvrouter.api.cli.settings import Launch, settings_from
from kvrouter.api.frontend.cli import build_parser as frontend_parser
from kvrouter.api.frontend.cli import options_from
from kvrouter.api.frontend.options import FrontendOptions


def frontend(argv: list[str], env: dict[str, str] | None = None) -> FrontendOptions:
    return options_from(frontend_parser().parse_args(argv), env or {})


def service(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> Launch:
    args = parse_arguments(service_parser(), [*argv, "--data-dir", str(tmp_path / "data")])
    return settings_from(args, env or {})


def comparable(options: Any) -> Any:
    """What the flags set (the JetStream consumer's name is drawn afresh per process without a data directory)."""
    fleet = attrs.evolve(options.fleet, jetstream=None)
    return options.router, options.host, options.port, options.block_size, fleet


@pytest.mark.parametrize(
    ("dynamo", "kvrouter"),
    [
        (["--http-port", "9001", "--http-host", "127.0.0.1"], ["--port", "9001", "--host", "127.0.0.1"]),
        (["--kv-cache-block-size", "32"], ["--block-size", "32"]),
        (["--no-router-kv-events"], ["--no-kv-events"]),
        (["--router-mode", "round_robin"], ["--router-mode", "round-robin"]),
        (
            ["--namespace", "prod", "--discovery-backend", "etcd"],
            ["--discovery-backend", "etcd", "--namespace", "prod"],
        ),
    ],
)
def test_the_frontends_dynamo_spellings_set_what_kvrouters_do(dynamo: list[str], kvrouter: list[str]) -> None:
    assert comparable(frontend(dynamo)) == comparable(frontend(kvrouter))
    assert comparable(frontend(dynamo)) != comparable(frontend([]))  # each changes something


def test_the_frontend_reads_dynamos_environment_and_a_flag_wins() -> None:
    env = {
        "DYN_HTTP_PORT": "9002",
        "DYN_HTTP_HOST": "127.0.0.1",
        "DYN_NAMESPACE": "prod",
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": "http://127.0.0.1:2399",
        "DYN_EVENT_PLANE": "nats",
        "NATS_SERVER": "nats://127.0.0.1:4299",
        "DYN_ROUTER_MODE": "random",
    }
    options = frontend([], env)
    assert (options.port, options.host, options.router.router_mode) == (9002, "127.0.0.1", "random")
    fleet = options.fleet
    assert (fleet.namespace, fleet.discovery_backend, fleet.event_plane) == ("prod", "etcd", "nats")
    assert (fleet.etcd_endpoints, fleet.nats_servers) == (("http://127.0.0.1:2399",), ("nats://127.0.0.1:4299",))
    assert frontend(["--http-port", "9003"], env).port == 9003
    with pytest.raises(InvalidSettings) as refused:
        frontend([], {"DYN_HTTP_PORT": "http", "DYN_ROUTER_MODE": "direct"})
    assert list(refused.value.problems) == [
        "DYN_HTTP_PORT='http' is not a whole number",
        "DYN_ROUTER_MODE='direct' is not a frontend mode (use kv, round-robin, random, kv-ttft)",
    ]
    with pytest.raises(InvalidSettings) as refused:  # a mode nobody has: the frontend's list, not the services'
        frontend([], {"DYN_ROUTER_MODE": "bogus"})
    assert list(refused.value.problems) == [
        "DYN_ROUTER_MODE='bogus' is not a frontend mode (use kv, round-robin, random, kv-ttft)"
    ]


def test_the_services_take_dynamos_spellings_and_environment(tmp_path: Path) -> None:
    dynamo = service(
        ["select-service", "--http-port", "9004", "--router-mode", "round_robin", "--no-router-kv-events"],
        tmp_path,
        {"DYN_HTTP_HOST": "127.0.0.1"},
    )
    ours = service(["select-service", "--port", "9004", "--router-mode", "round-robin", "--no-use-kv-events"], tmp_path)
    assert dynamo.router == ours.router and dynamo.router is not None
    assert (dynamo.router.router_mode, dynamo.router.use_kv_events) == ("round_robin", False)
    assert (dynamo.options.port, dynamo.options.host) == (ours.options.port, ours.options.host) == (9004, "127.0.0.1")
    weight = service(["select-service", "--kv-overlap-score-weight", "0.5"], tmp_path).router
    assert weight == service(["select-service", "--overlap-score-weight", "0.5"], tmp_path).router
    assert service(["slot-tracker"], tmp_path, {"DYN_HTTP_PORT": "9005"}).options.port == 9005


def test_a_flag_without_effect_is_one_warning_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        frontend(["--router-replica-sync", "--request-plane", "tcp"])
    assert [record.getMessage() for record in caplog.records] == [
        "--router-replica-sync has no effect: kvrouter replicas share their bookings over ZeroMQ: give "
        "--replica-sync-port and --replica-sync-peers (docs/operations/replicas.md)",
        "--request-plane tcp has no effect: kvrouter reaches workers over HTTP (the frontend) or does not call them "
        "(the services)",
    ]
    launch = service(["select-service", "--kv-cache-block-size", "16"], tmp_path)
    assert launch.warnings == (
        "--kv-cache-block-size 16 has no effect: the selection service takes each worker's block size from its "
        "registration or its model card",
    )
    launch = service(
        ["slot-tracker", "--router-mode", "kv", "--namespace", "dynamo", "--no-router-kv-events"], tmp_path
    )
    assert len(launch.warnings) == 3 and all("has no effect: the slot tracker" in line for line in launch.warnings)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["frontend", "--http-prot", "8000"],
            "kvrouter frontend: unrecognized arguments: --http-prot 8000; did you mean --http-port? (see --help)",
        ),
        (
            ["select-service", "--namespce", "dynamo"],
            "kvrouter select-service: unrecognized arguments: --namespce dynamo; did you mean --namespace? "
            "(see --help)",
        ),
        (
            ["slot-tracker", "--router-mod", "kv"],
            "kvrouter slot-tracker: unrecognized arguments: --router-mod kv; did you mean --router-mode? (see --help)",
        ),
        (["select-service", "--zzzz"], "kvrouter select-service: unrecognized arguments: --zzzz (see --help)"),
    ],
)
def test_an_unknown_flag_is_one_line_naming_the_nearest(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        kvrouter_main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == line + "\n"
