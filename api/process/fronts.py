"""``--fronts N``: N HTTP front processes on one port, one actor process that owns the state.

hypercorn-trio is pure Python and one process holds one core, so HTTP is spread over processes: the
**supervisor** (the process the operator started) binds the listening socket once, starts the **actor
process** (it locks the data directory, recovers the journal and runs the actors, KV listeners and the
replicator, exactly as ``--fronts 0`` does, minus hypercorn), and once that has recovered, N **front
processes** that inherit the listening socket and serve the same ASGI app and route table, with the
service objects replaced by proxies (``api/process/proxy.py``) that forward each call over ZMQ ipc to
the actor process's dispatcher (``api/process/dispatch.py``). Every child is the same ``kvrouter``
command line plus a hidden ``--process-role``, so all of them parse and check the same flags.

Why one inherited socket rather than SO_REUSEPORT: the port is bound once, so ``--port 0`` names one
port for every front, "port in use" is found before anything starts (one line, exit 2), a restarted
front joins the same socket with nothing to rebind, and no other process can join the port group. The
kernel wakes the fronts waiting on it; whichever accepts first serves the connection.

Supervision: a front that exits is started again (it holds nothing acknowledged: a reply means the actor
process made the write durable); the actor process exiting stops the service with one line (restart it:
recovery from the journal is the kill -9 case). SIGTERM/SIGINT: the supervisor closes its copy of the
socket, stops the fronts (each answers what is in flight, then closes), then the actor process (the
journal flushes and closes). Children get SIGTERM if the supervisor dies (PR_SET_PDEATHSIG), and ignore
SIGINT (a terminal's Ctrl-C reaches the whole process group: the supervisor orders the stop).

The ipc sockets live in a private runtime directory (mode 0700) under $XDG_RUNTIME_DIR or the temp dir,
short enough for the 107-byte limit of a unix socket path, removed when the service stops.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import trio
import zmq
from prometheus_client.multiprocess import mark_process_dead

from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.actors.transport.zmq_socket import open_socket
from kvrouter.api.http import Route
from kvrouter.api.http.app import make_app
from kvrouter.api.http.server import hypercorn_config, serve_http
from kvrouter.api.process.dispatch import SOCKET_HWM, Dispatcher
from kvrouter.api.process.main import ObjectsBuilder, ServiceObjects, ServiceOptions, counted, recovered_runtime
from kvrouter.api.process.proxy import RemoteService, ServiceLink
from kvrouter.api.routes.metrics import MULTIPROCESS_ENV
from kvrouter.api.streams.live import StreamSettings

log = logging.getLogger("kvrouter")

MAX_DEFAULT_FRONTS = 8  # the default is the number of cores, capped here
MAX_FRONTS = 64
REPLY_MARGIN_SECONDS = 5.0  # a front gives up on a call this long after the actor process's own deadline
RESTART_BACKOFF_SECONDS = 1.0  # a front that dies within this of starting is restarted after this long
CHILD_STOP_SECONDS = 5.0
WAIT_POLL_SECONDS = 0.1  # a second waiter for one child polls  # after a child's own shutdown grace, it is killed
IPC_PATH_LIMIT = 100  # sun_path holds 107 bytes; our names add at most ~20 to the directory
ACTOR_SOCKET = "actor"
FRONT_SOCKET = "front-{}"
METRICS_DIR = "metrics"


def default_fronts() -> int:
    return min(os.cpu_count() or 1, MAX_DEFAULT_FRONTS)


@attrs.frozen
class ServiceKind:
    """What differs between the two services in a process layout."""

    name: str  # "slot tracker", "selection service"
    service_class: type  # the service object's class (its methods are what fronts forward)
    build_objects: ObjectsBuilder
    routes: Callable[[ServiceObjects, StreamSettings], list[Route]]


@attrs.frozen
class ProcessRole:
    """A child's part (the hidden ``--process-role`` flags)."""

    kind: str  # "actor" or "front"
    runtime_dir: Path
    ready_fd: int
    supervisor_pid: int
    index: int = 0  # fronts only
    listen_fd: int = -1  # fronts only


def role_arguments(role: ProcessRole) -> list[str]:
    return [
        "--process-role",
        f"{role.kind},{role.runtime_dir},{role.ready_fd},{role.supervisor_pid},{role.index},{role.listen_fd}",
    ]


def parse_role(raw: str) -> ProcessRole:
    kind, runtime_dir, ready_fd, supervisor_pid, index, listen_fd = raw.split(",")
    if kind not in ("actor", "front"):
        raise ValueError(f"unknown process role {kind!r}")
    return ProcessRole(kind, Path(runtime_dir), int(ready_fd), int(supervisor_pid), int(index), int(listen_fd))


def ipc(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir}/{name}"


# -- the children -----------------------------------------------------------------------------------------


def become_child(role: ProcessRole) -> None:
    """Die with the supervisor, and leave Ctrl-C to it (see the module doc)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != role.supervisor_pid:
        raise SystemExit(1)  # the supervisor died before the line above took effect


def report_ready(role: ProcessRole, line: str) -> None:
    os.write(role.ready_fd, line.encode() + b"\n")
    os.close(role.ready_fd)


def open_dispatcher(objects: ServiceObjects, runtime_dir: Path) -> Dispatcher:
    """The actor process's end: calls from every front in ``runtime_dir`` run on ``objects``."""
    targets = {"service": objects.service, "peers": objects.peers}
    return Dispatcher(targets, ipc(runtime_dir, ACTOR_SOCKET), ipc(runtime_dir, FRONT_SOCKET))


def open_front_link(runtime_dir: Path, index: int, options: ServiceOptions) -> ServiceLink:
    """Front ``index``'s end (``await nursery.start(link.run)``): its reply socket bound, calls connected."""
    push = open_socket(zmq.PUSH, sndhwm=SOCKET_HWM, rcvhwm=SOCKET_HWM)
    pull = open_socket(zmq.PULL, sndhwm=SOCKET_HWM, rcvhwm=SOCKET_HWM)
    try:
        own = runtime_dir / FRONT_SOCKET.format(index)
        with contextlib.suppress(FileNotFoundError):
            own.unlink()  # left by this front's previous process
        pull.socket.bind(ipc(runtime_dir, FRONT_SOCKET.format(index)))
        push.socket.connect(ipc(runtime_dir, ACTOR_SOCKET))
    except BaseException:
        push.close()
        pull.close()
        raise
    give_up_after = options.reply_deadline + REPLY_MARGIN_SECONDS
    return ServiceLink(push, pull, front=index, incarnation=secrets.randbits(62), give_up_after=give_up_after)


def remote_objects(link: ServiceLink, service_class: type) -> ServiceObjects:
    """Stand-ins for the actor process's service objects, for the same routes."""
    peers = cast(PeerService, RemoteService(link, "peers", PeerService))  # same methods, forwarded
    return ServiceObjects(RemoteService(link, "service", service_class), peers)


async def run_actor_process(
    kind: ServiceKind, options: ServiceOptions, role: ProcessRole, on_journal_open: Callable[[], None]
) -> None:
    """Recover, run the actors and the dispatcher, until SIGTERM (or a journal failure)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with recovered_runtime(kind.name, options) as (runtime, scopes):
            on_journal_open()
            objects = await kind.build_objects(options, runtime.system, runtime.nursery)
            await runtime.nursery.start(open_dispatcher(objects, role.runtime_dir).run)
            report_ready(role, str(scopes))
            async with trio.open_nursery() as waiting:

                async def on_signal() -> None:
                    async for _ in signals:
                        runtime.stopping.set()
                        return

                waiting.start_soon(on_signal)
                await runtime.stopping.wait()
                waiting.cancel_scope.cancel()
            runtime.nursery.cancel_scope.cancel()
    if os.getppid() != role.supervisor_pid:  # the supervisor was killed: nobody else removes the sockets
        shutil.rmtree(role.runtime_dir, ignore_errors=True)


async def run_front_process(kind: ServiceKind, options: ServiceOptions, role: ProcessRole) -> None:
    """Serve HTTP on the inherited socket with proxies for the service objects, until SIGTERM."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        link = open_front_link(role.runtime_dir, role.index, options)
        routes = kind.routes(remote_objects(link, kind.service_class), options.streams)
        stopping = trio.Event()
        app = make_app(
            routes,
            body_limit=options.body_limit,
            body_timeout=options.http.body_timeout,
            auth=options.auth,
            stopping=stopping,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)

            async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                config = hypercorn_config(options.host, options.port, options.http)
                config.bind = [f"fd://{role.listen_fd}"]
                await serve_http(
                    app,
                    config,
                    stopping.wait,
                    max_connections=options.http.max_connections,
                    write_timeout=options.http.write_timeout,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # drained: stop the link

            await nursery.start(http)
            report_ready(role, "ok")
            async for _ in signals:
                stopping.set()
                break


# -- the supervisor ---------------------------------------------------------------------------------------


def runtime_directory() -> Path:
    """A private directory for the ipc sockets, with a path short enough for them."""
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if base and os.path.isdir(base) and len(base) < IPC_PATH_LIMIT - 40:
            return Path(tempfile.mkdtemp(prefix="kvrouter-", dir=base))
    raise OSError("no directory with a path short enough for the fronts' ipc sockets (set TMPDIR)")


def bind_listener(options: ServiceOptions) -> tuple[socket.socket, list[str]]:
    """The listening socket every front inherits (OSError: port in use, bad host, ...) and its URLs."""
    config = hypercorn_config(options.host, options.port, options.http)
    [sock] = config.create_sockets().insecure_sockets
    sock.listen(config.backlog)
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return sock, [f"http://{shown}:{port}"]


class _Process:
    """A child started from this (the main) thread, awaited through its pidfd.

    Not ``trio.lowlevel.open_process``: that forks from a worker thread, and PR_SET_PDEATHSIG fires when
    the *thread* that forked the child exits (trio's idle worker threads do after a few seconds)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pidfd = os.pidfd_open(popen.pid)
        self._watched = False  # one task at a time may park on the pidfd

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def send_signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    async def wait(self) -> int:
        while self.popen.poll() is None:
            if self._watched:
                await trio.sleep(WAIT_POLL_SECONDS)  # another task watches the pidfd
                continue
            self._watched = True
            try:
                await trio.lowlevel.wait_readable(self.pidfd)
            except trio.ClosedResourceError:
                pass  # another waiter saw the exit and closed the pidfd
            finally:
                self._watched = False
        if self.pidfd >= 0:
            fd, self.pidfd = self.pidfd, -1
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
        return self.popen.returncode


class _Child:
    """One child process and how to start it again."""

    def __init__(
        self, label: str, arguments: list[str], pass_fds: tuple[int, ...], env: dict[str, str] | None = None
    ) -> None:
        self.label = label
        self.arguments = arguments
        self.pass_fds = pass_fds
        self.env = env  # None: the supervisor's own
        self.process: _Process | None = None
        self.started_at = 0.0

    async def start(self, supervisor_pid: int, role: ProcessRole) -> str | None:
        """Start the child and wait for its ready line; None if it exited first."""
        read_end, write_end = os.pipe()
        try:
            role = attrs.evolve(role, ready_fd=write_end, supervisor_pid=supervisor_pid)
            self.process = _Process(
                subprocess.Popen(  # noqa: ASYNC220 - from this thread on purpose (see _Process); fork is quick
                    [*self.arguments, *role_arguments(role)],
                    pass_fds=(*self.pass_fds, write_end),
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                )
            )
        finally:
            os.close(write_end)
        self.started_at = time.monotonic()
        received = b""
        async with trio.lowlevel.FdStream(read_end) as ready:
            while not received.endswith(b"\n"):
                chunk = await ready.receive_some(256)
                if not chunk:
                    return None
                received += chunk
        return received.decode().strip()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    async def stop(self, seconds: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``seconds``."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        with trio.move_on_after(seconds):
            await self.process.wait()
            return
        log.warning("%s did not stop within %g s: killing it", self.label, seconds)
        self.signal(signal.SIGKILL)
        await self.process.wait()


async def supervise(name: str, options: ServiceOptions, argv: Sequence[str], fronts: int) -> int:
    """Run the actor process and ``fronts`` front processes until a signal (0) or the actor process ends
    (its status, 1 at least); a child's failure to start was logged by the child (its status)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        listener, urls = bind_listener(options)
        runtime_dir = runtime_directory()
        try:
            return await _supervise(name, options, argv, fronts, signals, listener, urls, runtime_dir)
        finally:
            listener.close()
            shutil.rmtree(runtime_dir, ignore_errors=True)


async def _supervise(
    name: str,
    options: ServiceOptions,
    argv: Sequence[str],
    count: int,
    signals: Any,
    listener: socket.socket,
    urls: list[str],
    runtime_dir: Path,
) -> int:
    command = [sys.executable, "-m", "kvrouter.api.cli.main", *argv]
    pid = os.getpid()
    actor = _Child("the actor process", command, ())
    scopes = await actor.start(pid, ProcessRole("actor", runtime_dir, -1, pid))
    if scopes is None:
        assert actor.process is not None
        return (await actor.process.wait()) or 1  # the actor process said why, in one line
    # The fronts count HTTP requests in prometheus-client's multiprocess mode, in files of a directory of
    # their own, so whichever front answers GET /metrics sums every front's (api/routes/metrics.py).
    metrics_dir = runtime_dir / METRICS_DIR
    metrics_dir.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, MULTIPROCESS_ENV: str(metrics_dir)}
    fronts = [_Child(f"front process {i}", command, (listener.fileno(),), env) for i in range(count)]
    roles = [ProcessRole("front", runtime_dir, -1, pid, i, listener.fileno()) for i in range(count)]
    for front, role in zip(fronts, roles, strict=True):
        if await front.start(pid, role) is None:
            await actor.stop(CHILD_STOP_SECONDS + options.http.shutdown_grace)
            assert front.process is not None
            return (await front.process.wait()) or 1
    log.info(
        "kvrouter %s listening on %s (%s, data dir %s, durability %s, %s recovered)",
        name,
        " ".join(urls),
        counted(count, "front"),
        options.data_dir,
        options.durability.value,
        counted(int(scopes), "scope"),
    )
    supervision = _Supervision(actor, list(zip(fronts, roles, strict=True)), metrics_dir, pid)
    status = await supervision.run(signals, listener, options)
    log.info("kvrouter %s stopped", name)
    return status


class _Supervision:
    """The running children until a signal or the actor process's end: fronts that exit are started again."""

    def __init__(self, actor: _Child, fronts: list[tuple[_Child, ProcessRole]], metrics_dir: Path, pid: int) -> None:
        self.actor = actor
        self.fronts = fronts
        self.metrics_dir = metrics_dir
        self.pid = pid
        self.status = 0
        self.stopping = False
        self.done = trio.Event()

    async def run(self, signals: Any, listener: socket.socket, options: ServiceOptions) -> int:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch_actor)
            for front, role in self.fronts:
                nursery.start_soon(self.keep_front, front, role)
            nursery.start_soon(self.watch_signals, signals)
            await self.done.wait()
            self.stopping = True
            listener.close()  # new connections are refused once every front has closed its copy
            grace = options.http.shutdown_grace + CHILD_STOP_SECONDS
            async with trio.open_nursery() as stops:
                for front, _ in self.fronts:
                    stops.start_soon(front.stop, grace)
            await self.actor.stop(grace + options.reply_deadline)
            nursery.cancel_scope.cancel()
        return self.status

    async def watch_actor(self) -> None:
        assert self.actor.process is not None
        code = await self.actor.process.wait()
        if not self.stopping:
            log.error(
                "the actor process exited (status %s): stopping the service; start it again to recover "
                "every acknowledged write from the journal",
                code,
            )
            self.status = 1
            self.done.set()

    async def keep_front(self, front: _Child, role: ProcessRole) -> None:
        while True:
            assert front.process is not None
            code = await front.process.wait()
            mark_process_dead(front.process.pid, str(self.metrics_dir))  # its live gauges no longer count
            if self.stopping:
                return
            log.warning("%s exited (status %s): starting it again", front.label, code)
            if time.monotonic() - front.started_at < RESTART_BACKOFF_SECONDS:
                await trio.sleep(RESTART_BACKOFF_SECONDS)
            if await front.start(self.pid, role) is not None:
                log.info("%s is serving again", front.label)
            elif not self.stopping:
                log.error("%s could not start again", front.label)

    async def watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            self.done.set()
            return
