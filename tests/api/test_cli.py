"""The ``kvrouter`` command line as an operator meets it: real processes, their exit status and their stderr.

A failure must be one line saying what happened and what to do, never a traceback; bad configuration exits 2.
Startup failures run as one batch of concurrent processes (a module fixture), so the suite pays for one
interpreter start-up, not ten.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from kvrouter.api.cli.main import build_parser, main
from kvrouter.api.process.main import lock_data_dir
from kvrouter.journal.frames import encode_frame
from kvrouter.journal.layout import segment_name

CLI = [sys.executable, "-m", "kvrouter.api.cli.main"]
TIMEOUT = 60


def run_cli(argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=tmp_path, env=child_env(tmp_path, env), capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def child_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    return {**env, "TMPDIR": str(tmp_path), **(extra or {})}


def the_error_line(stderr: str) -> str:
    """The one ERROR (or CRITICAL) line; fails if there is none, several, or any traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if " ERROR " in line or " CRITICAL " in line]
    assert len(errors) == 1, stderr
    return errors[0]


LISTENING = re.compile(r" listening on http://127\.0\.0\.1:(\d+) ")


class Service:
    """A service process started on ``--port 0``, and the port its own listening line names.

    Not a probe of a port picked beforehand: another process on this machine may bind that port first (ours then
    exits 2) or already listen on it (the probe then succeeds against a stranger). A thread reads stderr as it comes,
    so the service never blocks on a full pipe and the test sees every line.
    """

    def __init__(self, argv: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [*argv, "--port", "0"], cwd=tmp_path, env=child_env(tmp_path, env), stderr=subprocess.PIPE, text=True
        )
        self._lines: list[str] = []
        self._ports: queue.Queue[int | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            port = self._ports.get(timeout=TIMEOUT)  # a hang guard only: the line comes, or stderr closes
        except queue.Empty:
            self.kill()
            raise AssertionError(f"no listening line: {self.stderr()}") from None
        if port is None:
            raise AssertionError(f"exited with {self.process.wait(TIMEOUT)}: {self.stderr()}")
        self.port = port

    def _read(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self._lines.append(line)
                if found := LISTENING.search(line):
                    self._ports.put(int(found[1]))
        self._ports.put(None)  # stderr closed: the process has exited

    def stop(self) -> int:
        """SIGTERM (if still running), then the exit status once the process and its stderr have ended."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(TIMEOUT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(TIMEOUT)

    def stderr(self) -> str:
        """Everything the process wrote to stderr (waits for the end of the stream)."""
        self._reader.join(TIMEOUT)
        return "".join(self._lines)


# -- bad router settings and selection-cache flags (item 1) ----------------------------------------------


def test_a_nan_temperature_flag_stops_the_real_service_in_one_line(tmp_path: Path) -> None:
    # Before: accepted; /select answered 500 and the first /select_and_reserve killed the service.
    result = run_cli([sys.executable, "-m", "kvrouter.api.select_service", "--router-temperature", "nan"], tmp_path)
    assert result.returncode == 2
    line = the_error_line(result.stderr)
    assert "cannot start: --router-temperature='nan' must be a finite number" in line
    assert not (tmp_path / "kvrouter-data").exists()  # refused before anything was created


def test_a_bad_environment_variable_is_refused_the_same_way(tmp_path: Path) -> None:
    result = run_cli([*CLI, "select-service", "--port", "0"], tmp_path, {"DYN_ROUTER_PREFILL_LOAD_SCALE": "-2"})
    assert result.returncode == 2
    assert "cannot start: DYN_ROUTER_PREFILL_LOAD_SCALE='-2' must be >= 0" in the_error_line(result.stderr)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        # Before: a negative temperature or scale silently routed to the most loaded worker.
        (["--router-temperature", "-1"], "--router-temperature='-1' must be >= 0"),
        (["--router-temperature", "inf"], "--router-temperature='inf' must be a finite number"),
        (["--router-temperature", "1e999"], "--router-temperature='1e999' must be a finite number"),
        (["--prefill-load-scale", "-0.5"], "--prefill-load-scale='-0.5' must be >= 0"),
        (["--overlap-score-weight", "-1"], "--overlap-score-weight='-1' must be >= 0"),
        (["--overlap-score-credit", "nan"], "--overlap-score-credit='nan' must be a finite number"),
        (["--host-cache-hit-weight", "1.5"], "--host-cache-hit-weight='1.5' must be between 0 and 1"),
        (["--disk-cache-hit-weight", "-0.1"], "--disk-cache-hit-weight='-0.1' must be between 0 and 1"),
        # the environment's grammar: float() would take these, the DYN_* parser does not
        (["--router-temperature", "1_0"], "--router-temperature='1_0' is not a number"),
        (["--router-temperature", " 0.5"], "--router-temperature=' 0.5' is not a number"),
        (["--selection-cache-ttl-secs", "nan"], "--selection-cache-ttl-secs='nan' must be a finite number"),
        (["--selection-cache-ttl-secs", "soon"], "--selection-cache-ttl-secs='soon' is not a number"),
        (["--selection-cache-max-entries", "-1"], "--selection-cache-max-entries='-1' must be between 0 and"),
        (["--selection-cache-max-entries", "1.5"], "--selection-cache-max-entries='1.5' is not a whole number"),
        (["--selection-cache-max-bytes", "-1"], "--selection-cache-max-bytes='-1' must be between 0 and"),
        (["--selection-cache-max-bytes", "9" * 5000], "must be between 0 and 18446744073709551615"),
        (["--session-affinity-ttl-secs", "0"], "--session-affinity-ttl-secs='0' must be between 1 and 31536000"),
        (["--session-affinity-ttl-secs", "nan"], "--session-affinity-ttl-secs='nan' must be a finite number"),
        (["--port", "70000"], "--port='70000' must be between 0 and 65535"),
        (["--port", "http"], "--port='http' is not a whole number"),
        (["--replica-sync-port", "0"], "--replica-sync-port='0' must be between 1 and 65535"),
        (["--seed", "-1"], "--seed='-1' must be between 0 and"),
        (["--threads", "-1"], "--threads='-1' must be between 0 and"),
        (["--host", ""], "--host='' is empty"),
        (["--replica-sync-peers", "tcp://127.0.0.1:1"], "--replica-sync-peers requires --replica-sync-port"),
    ],
)
def test_bad_flags_stop_startup_with_one_line_naming_the_flag(
    flags: list[str], problem: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    assert main(["select-service", "--data-dir", str(tmp_path / "data"), *flags]) == 2
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is None
    assert record.getMessage().startswith("cannot start: ") and problem in record.getMessage()
    assert "\n" not in record.getMessage()
    assert not (tmp_path / "data").exists()


def test_every_bad_flag_and_variable_is_named_in_the_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_ROUTER_TEMPERATURE", "hot")
    caplog.set_level(logging.WARNING)
    argv = ["select-service", "--data-dir", str(tmp_path), "--port", "-1", "--prefill-load-scale", "-1"]
    assert main([*argv, "--selection-cache-max-entries", "x"]) == 2
    (record,) = caplog.records
    for name in ("--port", "--prefill-load-scale", "--selection-cache-max-entries", "DYN_ROUTER_TEMPERATURE"):
        assert name in record.getMessage()


# -- startup failures (item 2) ----------------------------------------------------------------------------


def corrupt_journal(path: Path) -> None:
    """Three records whose first one has a flipped payload byte: damage before valid records."""
    path.mkdir()
    frames = bytearray(b"".join(encode_frame(lsn, bytes(32)) for lsn in (1, 2, 3)))
    frames[16 + 3] ^= 0xFF
    (path / segment_name(1)).write_bytes(bytes(frames))


@pytest.fixture(scope="module")
def startup_failures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Each case's finished ``kvrouter slot-tracker`` process; all started at once."""
    root = tmp_path_factory.mktemp("startup")
    (root / "a-file").write_text("not a directory")
    corrupt_journal(root / "corrupt")
    with socket.socket() as busy, lock_data_dir(root / "locked"):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])
        cases = {
            "port in use": ["--port", taken],
            # Beyond loopback without a token: refused before these checks unless --insecure-no-auth is given.
            "host does not resolve": ["--host", "no-such-host.invalid", "--insecure-no-auth"],
            "host not local": ["--host", "192.0.2.1", "--insecure-no-auth"],  # TEST-NET-1: never this machine's
            "data dir is a file": ["--data-dir", str(root / "a-file")],
            "data dir under a file": ["--data-dir", str(root / "a-file" / "data")],
            "replica-sync port in use": ["--replica-sync-port", taken],
            "data dir locked": ["--data-dir", str(root / "locked")],
            "corrupt journal": ["--data-dir", str(root / "corrupt")],
        }
        if Path("/sys").is_dir():  # sysfs refuses new directories even to root, who ignores permission bits
            cases["data dir not writable"] = ["--data-dir", "/sys/kvrouter-test-data"]
        processes = {}
        for name, flags in cases.items():
            data_dir = ["--data-dir", str(root / name.replace(" ", "-"))] if "--data-dir" not in flags else []
            processes[name] = subprocess.Popen(
                [*CLI, "slot-tracker", "--port", "0", *data_dir, *flags],
                cwd=root,
                env=child_env(root),
                stderr=subprocess.PIPE,
                text=True,
            )
        results = {}
        for name, process in processes.items():
            _, stderr = process.communicate(timeout=TIMEOUT)
            results[name] = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    yield results


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("port in use", ["is already in use on 127.0.0.1", "pass another --port"]),
        ("host does not resolve", ["--host no-such-host.invalid does not resolve", "pass an IP address"]),
        ("host not local", ["192.0.2.1 is not an address of this machine", "--host a local address"]),
        ("data dir is a file", ["a-file is not a directory", "pass --data-dir a directory"]),
        ("data dir under a file", ["cannot use the data directory", "a-file is not a directory"]),
        ("replica-sync port in use", ["replica-sync port", "pass another --replica-sync-port"]),
        ("data dir locked", ["is in use by another kvrouter process", "another --data-dir"]),
        ("corrupt journal", ["journal corrupt", "lsn 1", "kvrouter journal quarantine --data-dir", "--lsn 1 --yes"]),
        ("data dir not writable", ["cannot use the data directory /sys/kvrouter-test-data", "this user can write"]),
    ],
)
def test_a_startup_failure_is_one_line_and_exit_status_2(
    case: str, says: list[str], startup_failures: dict[str, subprocess.CompletedProcess]
) -> None:
    if case not in startup_failures:
        pytest.skip("no /sys on this machine")
    result = startup_failures[case]
    assert result.returncode == 2, result.stderr
    line = the_error_line(result.stderr)
    assert "cannot start: " in line
    for words in says:
        assert words in line
    warnings = [line for line in result.stderr.splitlines() if "--insecure-no-auth" in line]
    assert len(warnings) == (1 if case.startswith("host") else 0), result.stderr  # said once, when given


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions (covered by /sys above)")
def test_a_read_only_data_dir_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    result = run_cli([*CLI, "slot-tracker", "--port", "0", "--data-dir", str(read_only / "data")], tmp_path)
    assert result.returncode == 2
    assert "this user can write" in the_error_line(result.stderr)


# -- a journal that fails while serving (item 2) -----------------------------------------------------------

# The child caps the size of any file it writes, and ignores the signal that would otherwise kill it: the
# journal's write(2) then fails with EFBIG, as a full disk fails it with ENOSPC.
FILE_SIZE_LIMITED = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
runpy.run_module("kvrouter.api.cli.main", run_name="__main__")
"""


def post(port: int, path: str, body: dict) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", orjson.dumps(body), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_journal_that_fails_while_serving_ends_in_one_line_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    limited = Service([sys.executable, "-c", FILE_SIZE_LIMITED, "slot-tracker", *data], tmp_path)
    acknowledged = 0
    try:
        for worker_id in range(5000):  # ~100 journal bytes each: the limit is hit long before the end
            body = {"worker_id": worker_id, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
            try:
                if post(limited.port, "/register", body) != 201:
                    break
            except OSError:  # the service stopped while answering
                break
            acknowledged += 1
        returncode = limited.process.wait(TIMEOUT)
    finally:
        limited.kill()
    stderr = limited.stderr()
    assert 0 < acknowledged < 5000
    assert returncode == 1
    assert "Traceback" not in stderr
    last = stderr.splitlines()[-1]
    assert " ERROR kvrouter: stopped: writing the journal in " in last
    assert "nothing acknowledged was lost" in last and "ulimit -f" in last and "restart" in last

    restarted = Service([*CLI, "slot-tracker", *data], tmp_path)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{restarted.port}/workers", timeout=10) as response:
            workers = orjson.loads(response.read())
    finally:
        restarted.stop()
    assert len(workers) >= acknowledged  # every 201 survived (one in flight may have been written too)


def test_a_sigterm_while_the_service_starts_stops_it_gracefully_once_started(tmp_path: Path) -> None:
    # Before: the signal receiver opened only after the listening line, so a SIGTERM sent on seeing that line (or any
    # earlier, as here, once recovery has logged) killed the process by the default action: status -15, no
    # "shutting down", journal not closed.
    argv = [*CLI, "slot-tracker", "--port", "0", "--data-dir", str(tmp_path / "data")]
    process = subprocess.Popen(argv, env=child_env(tmp_path), stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    seen: list[str] = []
    for line in process.stderr:
        seen.append(line)
        if " kvrouter.journal: recovered " in line:  # inside the service's start, before it listens
            process.send_signal(signal.SIGTERM)
            break
    _, rest = process.communicate(timeout=TIMEOUT)
    stderr = "".join(seen) + rest
    assert process.returncode == 0, stderr
    assert " INFO kvrouter: received SIGTERM: shutting down" in stderr
    assert " INFO kvrouter: journal closed: " in stderr
    assert "Traceback" not in stderr


# -- unexpected errors -------------------------------------------------------------------------------------

BROKEN_ROUTES = """
import sys
from kvrouter.api.cli import main as cli

async def broken_routes(options, system, nursery):
    raise RuntimeError("a bug in the route table")

cli.slot_tracker_app = broken_routes
sys.exit(cli.main())
"""


def test_an_unexpected_error_is_one_line_naming_the_file_that_holds_its_traceback(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", BROKEN_ROUTES, "slot-tracker", "--port", "0", "--data-dir", str(tmp_path / "d")]
    result = run_cli(argv, tmp_path)
    assert result.returncode == 1
    line = the_error_line(result.stderr)
    assert "stopped by an unexpected error" in line
    assert "[RuntimeError: a bug in the route table; traceback in " in line
    saved = Path(line.rsplit("traceback in ", 1)[1].rstrip("]"))
    assert saved.parent == tmp_path  # the system's temporary directory ($TMPDIR)
    text = saved.read_text()
    assert "Traceback" in text and "broken_routes" in text and "RuntimeError: a bug in the route table" in text


# -- a 1.6.1 launch script (item 3) ------------------------------------------------------------------------


def test_a_reference_launch_script_starts_kvrouter_and_each_ignored_flag_is_warned_once(tmp_path: Path) -> None:
    key = tmp_path / "tracking.key"
    key.write_bytes(bytes(range(32)))
    argv = [
        *CLI,
        "select-service",
        "--data-dir",
        str(tmp_path / "data"),
        "--threads",
        "8",
        "--session-affinity-ttl-secs",
        "600",
        "--selection-cache-ttl-secs",
        "60",
        "--selection-cache-max-entries",
        "100",
        "--selection-cache-max-bytes",
        "1048576",
        "--no-router-assume-kv-reuse",
        "--router-tracking-hash",
        "keyed-xxh3-v1",
        "--router-tracking-key-file",
        str(key),
        "--router-tracking-key-id",
        "epoch-7",
    ]
    service = Service(argv, tmp_path)
    returncode = service.stop()
    stderr = service.stderr()
    assert returncode == 0, stderr
    warnings = [
        line.split(" WARNING kvrouter: ", 1)[1] for line in stderr.splitlines() if " WARNING kvrouter: " in line
    ]
    for flag in (
        "--threads 8",
        "--no-router-assume-kv-reuse",
        "--router-tracking-hash keyed-xxh3-v1",
        "--router-tracking-key-file",
        "--router-tracking-key-id epoch-7",
    ):
        assert len([w for w in warnings if w.startswith(flag + " ")]) == 1, (flag, warnings)
    assert len(warnings) == 5  # --selection-cache-max-bytes is enforced, --session-affinity-ttl-secs implemented
    assert str(bytes(range(32))) not in stderr


# -- version, usage, help, data directories (item 4) --------------------------------------------------------


def test_version_is_the_installed_distribution_version(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["select-service", "--version"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        assert capsys.readouterr().out == f"kvrouter {importlib.metadata.version('kvrouter')}\n"


@pytest.mark.parametrize("service", ["select-service", "slot-tracker"])
def test_an_unknown_flag_is_one_line_naming_the_subcommand(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([service, "--bogus"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"kvrouter {service}: unrecognized arguments: --bogus (see --help)\n"


def test_a_flag_before_the_subcommand_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse alone said only that a subcommand is required, leaving the user to guess what was wrong."""
    with pytest.raises(SystemExit) as exited:
        main(["--port", "8092"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "kvrouter: unrecognized argument --port: the subcommand comes first, e.g. kvrouter select-service --port "
        "(see --help)\n"
    )


def test_every_flag_has_help_text() -> None:
    parser = build_parser()
    (services,) = [a for a in parser._actions if a.dest == "service"]
    for command in (parser, *services.choices.values()):
        for action in command._actions:
            if action.dest != "service":
                assert action.help and action.help.strip(), (command.prog, action.option_strings)


@pytest.mark.parametrize(("service", "default"), [("slot-tracker", 8091), ("select-service", 8092)])
def test_each_service_defaults_to_its_own_data_directory(service: str, default: int) -> None:
    from kvrouter.api.cli.settings import settings_from

    args = build_parser().parse_args([service])
    launch = settings_from(args, {})
    assert launch.options.data_dir == Path("kvrouter-data") / service
    assert launch.options.port == default


def test_a_journal_left_in_the_old_shared_default_directory_is_not_silently_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    corrupt_journal(tmp_path / "kvrouter-data")  # any journal file: it is not opened
    caplog.set_level(logging.WARNING)
    assert main(["slot-tracker", "--port", "0"]) == 2
    (record,) = caplog.records
    assert "./kvrouter-data holds a journal from an earlier kvrouter" in record.getMessage()
    assert "pass --data-dir kvrouter-data" in record.getMessage()
    assert not (tmp_path / "kvrouter-data" / "slot-tracker").exists()


def test_startup_line_says_one_scope_not_one_scopes() -> None:
    from kvrouter.api.process.main import counted

    assert [counted(n, "scope") for n in (0, 1, 2)] == ["0 scopes", "1 scope", "2 scopes"]
