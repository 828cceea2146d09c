"""``kvrouter worker-topology``: topology files (seed topology-aware-kv-transfer.md's worker contract), the wait
for the transfer-domain file, and registration with a real selection service."""

from __future__ import annotations

import io
import os
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.cli.main import main as cli_main
from kvrouter.api.cli.worker_topology import TopologyMissing, main, read_topology, wait_for_domain
from tests.conftest import start_select_service
from tests.support.processes import free_port


def test_each_non_hidden_non_empty_file_is_one_domain(tmp_path: Path) -> None:
    (tmp_path / "zone").write_text("us-east-1a\n")
    (tmp_path / "rack").write_text("  rack-22 ")
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / ".hidden").write_text("x")
    (tmp_path / "subdir").mkdir()
    # Kubernetes' Downward API: the visible names are symlinks into a hidden timestamped directory
    data = tmp_path / "..2026_11_23"
    data.mkdir()
    (data / "region").write_text("us-east")
    os.symlink(data / "region", tmp_path / "region")
    assert read_topology(tmp_path) == {"rack": "rack-22", "region": "us-east", "zone": "us-east-1a"}
    assert read_topology(tmp_path / "not-mounted") == {}


class FakeClock:
    def __init__(self, on_sleep: list) -> None:
        self.now = 0.0
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep:
            self.on_sleep.pop(0)()


def test_it_waits_for_the_transfer_domain_file_to_have_content(tmp_path: Path) -> None:
    steps = [lambda: (tmp_path / "zone").write_text(""), lambda: (tmp_path / "zone").write_text("a")]
    clock = FakeClock(steps)
    domains = wait_for_domain(
        tmp_path, "zone", timeout_secs=10, poll_secs=0.5, monotonic=clock.monotonic, sleep=clock.sleep
    )
    assert domains == {"zone": "a"} and clock.now == 1.0  # absent, then empty, then there


def test_it_gives_up_after_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "rack").write_text("r1")
    clock = FakeClock([])
    with pytest.raises(TopologyMissing, match=r"topology domain 'zone' has no non-empty file .*/zone after 2 s"):
        wait_for_domain(tmp_path, "zone", timeout_secs=2, poll_secs=0.5, monotonic=clock.monotonic, sleep=clock.sleep)
    assert clock.now == 2.0


@pytest.mark.parametrize(
    ("argv", "env", "problem"),
    [
        ([], {}, "--transfer-domain (or DYN_KV_TRANSFER_DOMAIN) is required"),
        (["--transfer-domain", "zone", "--policy", "preferred"], {}, "--policy preferred needs --weight (0-1)"),
        (["--transfer-domain", "zone", "--weight", "0.5"], {}, "--weight applies only to --policy preferred"),
        (["--transfer-domain", "zone", "--policy", "strict"], {}, "--policy='strict' must be required or preferred"),
        (
            ["--policy", "preferred", "--weight", "2"],
            {"DYN_KV_TRANSFER_DOMAIN": "zone"},
            "--weight='2' must be between",
        ),
        (["--transfer-domain", "zone", "--role", "encoder"], {}, "--role='encoder' must be one of prefill"),
        (["--transfer-domain", "zone"], {"DYN_KV_TRANSFER_ENFORCEMENT": "preferred"}, "needs --weight"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], env: dict[str, str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main([*argv, "--register", "http://127.0.0.1:1", "--worker-id", "7"], env)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and problem in err


async def run_main(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """The command in a thread (it blocks on HTTP) while the service runs on this trio loop."""
    out = io.StringIO()
    status = await trio.to_thread.run_sync(lambda: main(argv, env or {}, out))
    return status, out.getvalue()


async def test_it_registers_new_workers_and_patches_known_ones(
    nursery: trio.Nursery, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = await start_select_service(nursery, tmp_path / "data", RouterConfig(use_kv_events=False))
    url = handle.urls[0]
    topology = tmp_path / "topology"
    topology.mkdir()
    (topology / "rack").write_text("r7\n")
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await http.post("/workers", json={"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4})
        outcome: list[tuple[int, str]] = []

        async def run() -> None:
            outcome.append(
                await run_main(
                    ["--register", url, "--worker-id", "1", "--role", "prefill", "--timeout-secs", "60"],
                    {
                        "DYN_TOPOLOGY_MOUNT_PATH": str(topology),
                        "DYN_KV_TRANSFER_DOMAIN": "zone",
                        "DYN_KV_TRANSFER_ENFORCEMENT": "preferred",
                        "DYN_KV_TRANSFER_PREFERRED_WEIGHT": "0.8",
                    },
                )
            )

        async with trio.open_nursery() as waiting:
            waiting.start_soon(run)
            await trio.lowlevel.checkpoint()
            # without the transfer-domain file nothing can have been registered yet
            (record,) = (await http.get("/workers")).json()
            assert record["topology_domains"] == {}
            (topology / "zone").write_text("us-east-1a\n")
        status, printed = outcome[0]
        assert status == 0
        (record,) = (await http.get("/workers")).json()
        expected = {
            "topology_domains": {"rack": "r7", "zone": "us-east-1a"},
            "kv_transfer_domain": "zone",
            "kv_transfer_enforcement": "preferred",
            "kv_transfer_preferred_weight": 0.8,
            "worker_role": "prefill",
        }
        assert {key: record[key] for key in expected} == expected
        assert (record["endpoint"], record["block_size"]) == ("http://w1", 4)  # a PATCH keeps the rest
        assert printed.strip().startswith("{") and '"worker_id": 1' in printed

        # an unknown worker is registered with the registration flags
        status, _ = await run_main(
            [
                *("--dir", str(topology), "--transfer-domain", "rack", "--register", url, "--worker-id", "2"),
                *("--model-name", "m", "--endpoint", "http://w2", "--block-size", "4", "--role", "decode"),
            ]
        )
        assert status == 0
        second = (await http.get("/workers")).json()[1]
        assert (second["worker_id"], second["lifecycle"], second["kv_transfer_enforcement"]) == (
            2,
            "schedulable",
            "required",
        )
        assert second["topology_domains"] == {"rack": "r7", "zone": "us-east-1a"}
    handle.stop()
    capsys.readouterr()


async def test_a_missing_domain_or_an_unreachable_service_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--dir", str(tmp_path), "--transfer-domain", "zone", "--worker-id", "3"]
    status, _ = await run_main([*base, "--register", "http://127.0.0.1:1", "--timeout-secs", "0.05"])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1 and "topology domain 'zone' has no non-empty file" in err
    (tmp_path / "zone").write_text("a")
    closed = f"http://127.0.0.1:{free_port()}"
    status, _ = await run_main([*base, "--register", closed])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1
    assert err.startswith(f"kvrouter worker-topology: cannot register worker 3 with {closed}: ")


def test_the_kvrouter_command_dispatches_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["worker-topology", "--register", "http://x", "--worker-id", "1"]) == 2
    assert "--transfer-domain" in capsys.readouterr().err
