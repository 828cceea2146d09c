"""The HTTP front's flags as an operator meets them: real processes, one line and exit 2 for bad configuration."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvrouter.api.cli.main import build_parser
from kvrouter.api.cli.settings import settings_from
from kvrouter.api.http.server import HttpSettings
from tests.api.test_cli import CLI, Service, run_cli, the_error_line


def launch(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return settings_from(build_parser().parse_args(argv), env or {})


def test_the_front_flags_reach_the_service_options(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    options = launch(
        [
            "select-service",
            "--auth-token-file",
            str(token),
            "--http-idle-timeout-secs",
            "2.5",
            "--http-body-timeout-secs",
            "7",
            "--http-max-connections",
            "9",
            "--shutdown-grace-secs",
            "4",
        ]
    ).options
    assert options.http == HttpSettings(idle_timeout=2.5, body_timeout=7.0, max_connections=9, shutdown_grace=4.0)
    assert options.auth is not None and options.auth.admits(b"Bearer t0ken")
    defaults = launch(["slot-tracker"]).options
    assert defaults.http == HttpSettings() and defaults.auth is None


def test_the_token_file_may_come_from_the_environment_and_the_flag_wins(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("from-env")
    (tmp_path / "b").write_text("from-flag")
    env = {"KVROUTER_AUTH_TOKEN_FILE": str(tmp_path / "a")}
    from_env = launch(["slot-tracker"], env).options.auth
    assert from_env is not None and from_env.admits(b"Bearer from-env")
    from_flag = launch(["slot-tracker", "--auth-token-file", str(tmp_path / "b")], env).options.auth
    assert from_flag is not None and from_flag.admits(b"Bearer from-flag") and not from_flag.admits(b"Bearer from-env")


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    token.chmod(0o644)
    warnings = launch(["slot-tracker", "--auth-token-file", str(token)]).warnings
    assert any("readable by other users" in warning and "chmod 600" in warning for warning in warnings)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--auth-token-file", "missing-file"], "--auth-token-file='missing-file' cannot be read"),
        (["--auth-token-file", "empty"], "--auth-token-file='empty' is empty"),
        (["--http-idle-timeout-secs", "0"], "--http-idle-timeout-secs='0' must be between"),
        (["--http-body-timeout-secs", "nan"], "--http-body-timeout-secs='nan' must be a finite number"),
        (["--http-max-connections", "0"], "--http-max-connections='0' must be between 1"),
        (["--shutdown-grace-secs", "-1"], "--shutdown-grace-secs='-1' must be between"),
    ],
)
def test_bad_front_flags_stop_startup_in_one_line(tmp_path: Path, flags: list[str], says: str) -> None:
    (tmp_path / "empty").write_text("")
    result = run_cli([*CLI, "slot-tracker", "--port", "0", *flags], tmp_path)
    assert result.returncode == 2, result.stderr
    assert says in the_error_line(result.stderr)


def test_an_unreadable_token_file_from_the_environment_is_one_line(tmp_path: Path) -> None:
    result = run_cli([*CLI, "slot-tracker", "--port", "0"], tmp_path, {"KVROUTER_AUTH_TOKEN_FILE": "nope"})
    assert result.returncode == 2
    assert "KVROUTER_AUTH_TOKEN_FILE='nope' cannot be read" in the_error_line(result.stderr)


def test_the_other_services_data_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    tracker = Service([*CLI, "slot-tracker", "--data-dir", "shared"], tmp_path)
    assert tracker.stop() == 0, tracker.stderr()
    result = run_cli([*CLI, "select-service", "--port", "0", "--data-dir", "shared"], tmp_path)
    assert result.returncode == 2
    line = the_error_line(result.stderr)
    assert "cannot start: the data directory shared belongs to the slot tracker" in line
    assert "give this selection service its own --data-dir" in line


def test_a_token_protected_service_answers_only_with_the_token(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("the-token\n")
    (tmp_path / "token").chmod(0o600)
    service = Service([*CLI, "slot-tracker", "--log-level", "debug"], tmp_path, {"KVROUTER_AUTH_TOKEN_FILE": "token"})
    try:
        url = f"http://127.0.0.1:{service.port}"
        with urllib.request.urlopen(f"{url}/health", timeout=10) as health:
            assert health.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/loads", timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        request = urllib.request.Request(f"{url}/loads", headers={"authorization": "Bearer the-token"})
        with urllib.request.urlopen(request, timeout=10) as allowed:
            assert allowed.status == 200
    finally:
        returncode = service.stop()
    stderr = service.stderr()
    assert returncode == 0, stderr
    assert "GET /loads 401" in stderr and "GET /loads 200" in stderr  # one debug line per request
    assert "the-token" not in stderr
