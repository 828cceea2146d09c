"""kvrouter slot-tracker replicas of one cluster (``--cluster``), each its own process on a free port of its place
(127.0.0.1, or its network namespace's address, which it advertises) with its own data directory, sharing a bearer
token: started, killed with SIGKILL and started again, paused (SIGSTOP) and resumed, stopped; always by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from kvrouter.simulations.process_faults.servers import LOOPBACK, Place, free_port, stop

START_SECONDS = 60.0
START_ATTEMPTS = 3
TOKEN = "process-faults-token"


def token_file(directory: Path) -> Path:
    """The bearer token every replica shares (a replica bound to an address other than loopback needs one)."""
    path = directory / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


class Replica:
    def __init__(self, directory: Path, name: str, argv_tail: list[str], place: Place = LOOPBACK) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://{place.address}:{self.port}"
        self.data_dir = directory / name
        self.log = directory / f"{name}.log"
        self.argv = place.argv([
            sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--host", place.address,
            "--port", str(self.port), "--data-dir", str(self.data_dir), "--advertise-url", self.url,
            "--auth-token-file", str(token_file(directory)), *argv_tail,
        ])  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.wanted_up = True  # False while the nemesis holds it killed
        self.relaunches = 0  # started again after it exited on its own (e.g. NATS unreachable at start: exit 2)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=log)

    async def wait_healthy(self, http: httpx.AsyncClient) -> None:
        """Until it answers ``/health``. One that exits meanwhile (at start, three replicas creating the stream
        and bucket at once on two loaded cores can run out of time: exit 2) is started again, twice at most."""
        exits = 0
        with trio.fail_after(START_SECONDS):
            while True:
                if not self.running and exits < START_ATTEMPTS - 1:
                    exits += 1
                    self.relaunches += 1
                    self.launch()
                elif not self.running:
                    raise RuntimeError(f"replica {self.name} exited at start {START_ATTEMPTS} times: see {self.log}")
                try:
                    if (await http.get(f"{self.url}/health", timeout=1)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)

    def relaunch(self) -> None:
        """After the nemesis' kill: wanted up again, started."""
        self.wanted_up = True
        self.launch()

    async def supervise(self) -> None:
        """Start it again whenever it exited on its own while wanted up (cancelled at the end of the run)."""
        while True:
            await trio.sleep(0.5)
            if self.wanted_up and self.process is not None and self.process.poll() is not None:
                self.relaunches += 1
                self.launch()

    def kill9(self) -> None:
        self.wanted_up = False
        if self.process is not None and self.running:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.running:
            os.kill(self.process.pid, signum)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def cluster_argv(name: str, etcd: str, nats: list[str], replicas: int, ttl: int) -> list[str]:
    """The flags every replica of the cluster shares."""
    return [
        "--cluster", name, "--etcd-endpoints", etcd, "--nats-server", ",".join(nats),
        "--jetstream-replicas", str(replicas), "--cluster-lease-ttl", str(ttl), "--log-level", "warning",
    ]  # fmt: skip
