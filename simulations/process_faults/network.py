"""A network of its own for a fault run: each process in a network namespace with one address, all joined by veth
pairs to a bridge in the root namespace (which holds the bridge's address, so clients there reach every process),
and partitions that cut chosen paths between namespaces.

A cut from A to B makes A send B's packets to a link-layer address nobody has (a permanent neighbour entry in A's
namespace): the bridge floods them and every namespace drops them, so they are lost silently, as on a broken
network; a connection already open stops delivering and is delivered again once healed, and a new one gets no
answer. A cut is set on both sides. The root namespace is never cut. (Chosen because it needs only ``ip``: the
kernels this runs on may have no netfilter and no tc classifier or action.)

Names carry the PID of the run (``kvf<pid>``, ``kvf<pid>-<host>``), so concurrent runs do not collide, and a
leftover of a run whose PID is gone is deleted at the start of the next. Synchronous (``subprocess``)."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess

import attrs

PREFIX = "kvf"
NOWHERE = "02:00:00:00:00:01"  # a locally administered unicast address no interface here has
SUBNETS = 512  # /24 networks of 198.18.0.0/15 (set aside for network tests)
NAME = re.compile(rf"^{PREFIX}(\d+)(?:-|[hp]\d|$)")


class NetworkUnavailable(Exception):
    """Namespaces cannot be made here: why, in one line."""


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetworkUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def network_missing() -> str | None:
    """Why this machine cannot run processes in network namespaces, in one line; None if it can."""
    if shutil.which("ip") is None:
        return "network namespaces need the `ip` command (iproute2), which is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root (this runs as uid {os.geteuid()})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except NetworkUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


@attrs.frozen
class Host:
    name: str
    namespace: str
    address: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it: the PID is the process's own)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Delete the namespaces and links of runs whose PID is gone (the processes left inside such a namespace are
    killed by PID first); the names deleted."""
    deleted = []
    for line in _ip("netns", "list").splitlines():
        namespace = line.split(" ", 1)[0]
        owner = NAME.match(namespace)
        if owner is None or _alive(int(owner.group(1))):
            continue
        for pid in _ip("netns", "pids", namespace, check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", namespace, check=False)
        deleted.append(namespace)
    for line in _ip("-o", "link", "show").splitlines():
        link = line.split(": ")[1].split("@")[0] if ": " in line else ""
        owner = NAME.match(link)
        if owner is not None and not _alive(int(owner.group(1))):
            _ip("link", "del", link, check=False)
            deleted.append(link)
    return deleted


def _free_subnet(start: int) -> str:
    """The first /24 of 198.18.0.0/15, from ``start`` on, that no route of the root namespace covers."""
    routes = _ip("-4", "route", "show", "table", "all")
    for index in itertools.chain(range(start, SUBNETS), range(start)):
        prefix = f"198.{18 + index // 256}.{index % 256}"
        if f"{prefix}.0/24" not in routes:
            return prefix
    raise NetworkUnavailable("no free /24 in 198.18.0.0/15 for the run's bridge")


class Network:
    """The bridge and one namespace per host name; ``cut``/``heal`` partitions. Use as a context manager: all of it
    is deleted on the way out, whatever happened."""

    def __init__(self, names: list[str]) -> None:
        self.run = f"{PREFIX}{os.getpid()}"
        self.bridge = self.run
        self.names = names
        self.hosts: dict[str, Host] = {}
        self.cuts: set[tuple[str, str]] = set()  # (from, to): from's packets to `to` are lost

    def __enter__(self) -> Network:
        clean_leftovers()
        try:
            self._create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.delete()

    def _create(self) -> None:
        prefix = _free_subnet(os.getpid() % SUBNETS)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(self.names):
            host = Host(name, f"{self.run}-{name}", f"{prefix}.{index + 2}")
            self.hosts[name] = host
            outside, inside = f"{self.run}h{index}", f"{self.run}p{index}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("-n", host.namespace, "link", "set", inside, "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")

    def delete(self) -> None:
        """Every veth pair (deleted here: a namespace's deletion frees its veth later, in the background), every
        namespace, then the bridge; what is already gone is skipped."""
        for index, name in enumerate(self.names):
            _ip("link", "del", f"{self.run}h{index}", check=False)
            _ip("netns", "del", f"{self.run}-{name}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def cut(self, side: list[str], other: list[str]) -> None:
        """Lose every packet between a host of ``side`` and a host of ``other``, both ways."""
        for a, b in itertools.product(side, other):
            for source, target in ((a, b), (b, a)):
                address = self.hosts[target].address
                namespace = self.hosts[source].namespace
                _ip("-n", namespace, "neigh", "replace", address, "lladdr", NOWHERE, "nud", "permanent", "dev", "eth0")
                self.cuts.add((source, target))

    def heal(self) -> None:
        """Every cut path carries packets again (the neighbour is learnt afresh)."""
        for source, target in sorted(self.cuts):
            namespace = self.hosts[source].namespace
            _ip("-n", namespace, "neigh", "del", self.hosts[target].address, "dev", "eth0", check=False)
        self.cuts.clear()
