"""Who can reach a service: bound to an address other than loopback, every service (slot tracker, selection
service, ``--fronts`` layout, frontend, mock worker) starts only with a bearer token or ``--insecure-no-auth`` (one
warning line); and ``--worker-endpoint-allow`` on the services that accept worker endpoints. Nothing here binds
anything but 127.0.0.1: a refused start stops before binding.

Before: ``--host 0.0.0.0`` with no token served every route to anyone who reached the port."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import pytest

from kvrouter.actors.core.router_config import InvalidSettings
from kvrouter.actors.core.worker_endpoints import parse_allow_list
from kvrouter.api.cli.main import build_parser
from kvrouter.api.cli.main import main as kvrouter_main
from kvrouter.api.cli.settings import Launch, settings_from
from kvrouter.api.frontend.cli import build_parser as frontend_parser
from kvrouter.api.frontend.cli import main as frontend_main
from kvrouter.api.frontend.cli import options_from
from kvrouter.api.mock_worker.cli import main as mock_worker_main
from kvrouter.api.process.exposure import is_loopback

EXPOSED = ["0.0.0.0", "::", "10.1.2.3", "192.0.2.1", "[::]", "my-host.example", "fe80::1"]
REFUSAL = "is reachable from other machines and no --auth-token-file"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", EXPOSED)
def test_every_other_address_or_name_counts_as_exposed(host: str) -> None:
    assert not is_loopback(host)


def launch(service: str, *flags: str, env: dict[str, str] | None = None) -> Launch:
    return settings_from(build_parser().parse_args([service, "--data-dir", "d", *flags]), env or {})


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
@pytest.mark.parametrize("host", EXPOSED)
def test_a_service_bound_beyond_loopback_without_a_token_is_refused(service: str, host: str) -> None:
    with pytest.raises(InvalidSettings) as raised:
        launch(service, "--host", host)
    (problem,) = raised.value.problems
    assert f"--host {host} {REFUSAL}" in problem and "--insecure-no-auth" in problem


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
def test_a_token_or_insecure_no_auth_lets_it_start(service: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    assert launch(service, "--host", "0.0.0.0", "--auth-token-file", str(token)).warnings == ()
    env = {"KVROUTER_AUTH_TOKEN_FILE": str(token)}
    assert launch(service, "--host", "0.0.0.0", env=env).warnings == ()
    insecure = launch(service, "--host", "0.0.0.0", "--insecure-no-auth")
    (warning,) = insecure.warnings
    assert warning.startswith("--insecure-no-auth: serving on --host 0.0.0.0 without authentication")
    assert launch(service, "--insecure-no-auth").warnings == ()  # loopback: nothing to warn about


def test_the_children_of_a_fronts_supervisor_do_not_repeat_the_warning() -> None:
    """They run the supervisor's command line again: one warning line in all, from the supervisor."""
    argv = ["--host", "0.0.0.0", "--insecure-no-auth", "--fronts", "2"]
    assert len(launch("select-service", *argv).warnings) == 1
    child = launch("select-service", *argv, "--process-role", "front,/tmp,0,1,0,0")
    assert child.warnings == ()


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
def test_the_refusal_is_one_line_and_exit_2(service: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert kvrouter_main([service, "--data-dir", str(tmp_path / "data"), "--host", "0.0.0.0"]) == 2
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.getMessage().startswith("cannot start: --host 0.0.0.0 ")
    assert "\n" not in record.getMessage() and not (tmp_path / "data").exists()


# -- --worker-endpoint-allow --------------------------------------------------------------------------------------


def test_the_allow_list_reaches_the_selection_service_config() -> None:
    router = launch(
        "select-service", "--worker-endpoint-allow", "10.0.0.0/8,w1", "--worker-endpoint-allow", ".gpu"
    ).router
    assert router is not None and router.worker_endpoint_allow == parse_allow_list(["10.0.0.0/8,w1", ".gpu"])
    assert router.worker_endpoint_allow.networks == (ipaddress.ip_network("10.0.0.0/8"),)
    default = launch("select-service").router
    assert default is not None and default.worker_endpoint_allow is None  # any host


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "--worker-endpoint-allow: no host or network given"),
        ("10.0.0.1/8", "--worker-endpoint-allow: `10.0.0.1/8` is not a CIDR network"),
        ("10.0.0.0/40", "`10.0.0.0/40` is not a CIDR network"),
        ("http://w1", "`http://w1` is not a host name, .domain, IP address or CIDR network"),
        ("w1:8000", "`w1:8000` is not a host name"),
    ],
)
def test_a_bad_allow_list_is_one_line_and_exit_2(
    value: str, says: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    argv = ["select-service", "--data-dir", str(tmp_path / "data"), "--worker-endpoint-allow", value]
    assert kvrouter_main(argv) == 2
    (record,) = caplog.records
    assert record.getMessage().startswith("cannot start: ") and says in record.getMessage()


def test_the_slot_tracker_takes_no_worker_endpoints() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["slot-tracker", "--worker-endpoint-allow", "w1"])


# -- the frontend and the mock worker -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--host", "0.0.0.0"], f"--host 0.0.0.0 {REFUSAL}"),
        (["--host", "::"], f"--host :: {REFUSAL}"),
        (["--worker-endpoint-allow", "10.0.0.1/8"], "--worker-endpoint-allow: `10.0.0.1/8` is not a CIDR network"),
        (
            ["--workers", "http://127.0.0.1:8101/secret#"],
            "--workers: `http://127.0.0.1:8101/secret#` has a fragment",
        ),
        (["--workers", "http://u:p@127.0.0.1:8101"], "has user information"),
        (
            ["--workers", "http://127.0.0.1:8101", "--worker-endpoint-allow", "10.0.0.0/8"],
            "--workers: endpoint: host `127.0.0.1` is not in the operator's allow-list",
        ),
        (
            ["--workers", "http://10.0.0.1:8101=tcp://127.0.0.1:5601", "--worker-endpoint-allow", "10.0.0.0/8"],
            "--workers: KV-events endpoint: host `127.0.0.1` is not in the operator's allow-list",
        ),
    ],
)
def test_the_frontend_refuses_in_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, flags: list[str], text: str
) -> None:
    assert frontend_main(flags) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    lines += [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1 and text in lines[0], lines


def test_the_frontend_with_insecure_no_auth_warns_once_and_keeps_the_allow_list(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    argv = ["--host", "0.0.0.0", "--insecure-no-auth", "--worker-endpoint-allow", "w1", "--workers", "http://w1:8000"]
    options = options_from(frontend_parser().parse_args(argv), {})
    assert options.router.worker_endpoint_allow == parse_allow_list(["w1"])
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage().startswith("--insecure-no-auth: serving on")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_the_mock_worker_bound_beyond_loopback_needs_insecure_no_auth(
    host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It has no authentication at all (it is a test worker): only the explicit flag lets it listen beyond
    loopback."""
    caplog.set_level(logging.WARNING)
    assert mock_worker_main(["--host", host, "--port", "0", "--kv-events-port", "0"]) == 2
    (record,) = caplog.records
    assert f"cannot start: --host {host} is reachable from other machines" in record.getMessage()
    assert "--insecure-no-auth" in record.getMessage()
