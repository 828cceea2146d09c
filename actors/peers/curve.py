"""CURVE keys for replica sync: this replica's certificate, the certificates of the replicas it trusts,
and the ZAP handler that admits subscribers by key.

Key files are ZeroMQ certificates in pyzmq's (czmq's) text format, as ``zmq.auth`` reads them: ``NAME.key``
holds a public key, ``NAME.key_secret`` the same public key plus its secret key. ``kvrouter keys generate``
(:func:`write_certificates`) writes both, with ``zmq.curve_keypair``; the public certificate also names, in its
``metadata`` section, the endpoint(s) its owner publishes on::

    metadata
        endpoint = "tcp://10.0.0.1:5555"
    curve
        public-key = "..."

Roles on the wire. Our PUB is a CURVE server: it proves our key to subscribers and asks the ZAP handler
about each subscriber's key, which must be one of the public certificates in the peer-keys directory
(``TrustedPeers.allows``); anyone else completes no handshake and reads nothing. Each of our SUBs is a
CURVE client that requires the peer's PUB to prove the key of the certificate naming that endpoint
(``TrustedPeers.server_key_for``), so a process at a peer's address without the peer's secret key cannot
feed us. Everything between peers is encrypted.

The directory is read at startup and again when it changes (certificate files added, removed or
rewritten): on an unknown subscriber key (from the ZAP thread) and on every peer registration. A
directory that turns unreadable or invalid at run time keeps the previous set (logged once).

ZAP is one handler per zmq context (``inproc://zeromq.zap.01``), and the context is process-wide, so
one ``zmq.auth`` ThreadAuthenticator serves every replicator in the process, each under its own ZAP
domain (:func:`zap_domain`); it starts with the first one and stays.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import attrs
import zmq
from zmq.auth import load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvrouter.actors.transport.zmq_socket import zmq_context

log = logging.getLogger("kvrouter.replica")

Z85_KEY_LENGTH: Final = 40  # a 32-byte CURVE key in Z85 text
PUBLIC_SUFFIX: Final = ".key"
SECRET_SUFFIX: Final = ".key_secret"
# Subscriber keys refused by the ZAP handler are logged once each; this many are remembered (then refusals
# are only counted, so a flood of fresh keys cannot grow memory).
LOGGED_REFUSALS_LIMIT: Final = 256


class CurveConfigError(Exception):
    """A key file or directory cannot be used; ``str`` is one line naming it and what to do."""


@attrs.frozen
class CurveIdentity:
    """This replica's key pair (Z85 text, as libzmq's CURVE socket options take it)."""

    public_key: bytes
    secret_key: bytes
    source: Path
    warnings: tuple[str, ...] = ()


def load_identity(path: Path) -> CurveIdentity:
    """This replica's secret certificate; raises CurveConfigError naming the problem."""
    flag = "--replica-curve-secret-key-file"
    try:
        mode = path.stat().st_mode
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CurveConfigError(f"{flag} {path}: cannot read a certificate ({reason})") from None
    if secret is None:
        raise CurveConfigError(
            f"{flag} {path} holds no secret key (a public certificate?); pass the NAME{SECRET_SUFFIX} file that "
            "`kvrouter keys generate` wrote"
        )
    for name, key in (("public", public), ("secret", secret)):
        if not _valid_key(key):
            raise CurveConfigError(f"{flag} {path}: the {name} key is not {Z85_KEY_LENGTH} characters of Z85 text")
    warnings: tuple[str, ...] = ()
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings = (f"{flag} {path} is readable by other users: chmod 600 it",)
    return CurveIdentity(public, secret, path, warnings)


@attrs.frozen
class _Certificates:
    keys: frozenset[bytes]  # public keys (Z85) allowed to subscribe
    by_endpoint: dict[str, bytes]  # endpoint -> the public key its PUB must prove
    signature: tuple[tuple[str, int, int], ...]  # (name, mtime_ns, size) of every *.key file read


class TrustedPeers:
    """The public certificates in the peer-keys directory. Thread-safe: the ZAP thread reads it too."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._reload_failed = False
        self._certificates = _read_directory(directory)  # CurveConfigError at startup

    @property
    def keys(self) -> frozenset[bytes]:
        return self._certificates.keys

    def endpoints(self) -> dict[str, bytes]:
        return dict(self._certificates.by_endpoint)

    def allows(self, public_key: bytes) -> bool:
        """True if ``public_key`` (Z85) belongs to a trusted replica; re-reads the directory if it changed."""
        if public_key in self._certificates.keys:
            return True
        self.refresh()
        return public_key in self._certificates.keys

    def server_key_for(self, endpoint: str) -> bytes | None:
        """The key the PUB at ``endpoint`` must prove (re-reading a changed directory first), or None."""
        self.refresh()
        return self._certificates.by_endpoint.get(endpoint)

    def refresh(self) -> None:
        """Re-read the directory if its certificate files changed; on failure keep what was read before."""
        with self._lock:
            try:
                if _signature(self.directory) == self._certificates.signature:
                    return
                self._certificates = _read_directory(self.directory)
            except CurveConfigError as exc:
                if not self._reload_failed:
                    log.warning("replica peer keys not reloaded, keeping the previous ones: %s", exc)
                self._reload_failed = True
                return
            if self._reload_failed:
                log.info("replica peer keys reloaded from %s", self.directory)
            self._reload_failed = False


def _signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    flag = "--replica-curve-peer-keys-dir"
    try:
        entries = []
        for entry in os.scandir(directory):
            if entry.name.endswith(PUBLIC_SUFFIX) and entry.is_file():
                info = entry.stat()
                entries.append((entry.name, info.st_mtime_ns, info.st_size))
    except OSError as exc:
        raise CurveConfigError(f"{flag} {directory}: cannot list it ({exc.strerror or exc})") from None
    return tuple(sorted(entries))


def _read_directory(directory: Path) -> _Certificates:
    flag = "--replica-curve-peer-keys-dir"
    signature = _signature(directory)
    keys: set[bytes] = set()
    by_endpoint: dict[str, bytes] = {}
    for name, _, _ in signature:
        path = directory / name
        try:
            public, _ = load_certificate(path)
            endpoints = _metadata_endpoints(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CurveConfigError(f"{flag}: cannot read the certificate {path} ({reason})") from None
        if not _valid_key(public):
            raise CurveConfigError(f"{flag}: {path}: the public key is not {Z85_KEY_LENGTH} characters of Z85 text")
        keys.add(public)
        for endpoint in endpoints:
            other = by_endpoint.setdefault(endpoint, public)
            if other != public:
                raise CurveConfigError(f"{flag} {directory}: two certificates name the endpoint {endpoint}; keep one")
    return _Certificates(frozenset(keys), by_endpoint, signature)


def _metadata_endpoints(text: str) -> list[str]:
    """The ``endpoint`` entries of a certificate's ``metadata`` section (comma-separated values allowed)."""
    section = None
    found: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            section = line.strip()
            continue
        key, separator, value = line.strip().partition("=")
        if section == "metadata" and separator and key.strip() == "endpoint":
            found.extend(part.strip() for part in value.strip().strip("\"'").split(",") if part.strip())
    return found


def _valid_key(key: bytes) -> bool:
    if len(key) != Z85_KEY_LENGTH:
        return False
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError):
        return False
    return True


# -- generating ---------------------------------------------------------------------------------------


def write_certificates(directory: Path, name: str, endpoints: list[str]) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, naming ``endpoints``) and ``NAME.key_secret`` (mode 600) in ``directory``.

    Refuses to overwrite either file (OSError). Returns (public path, secret path).
    """
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path, secret_path = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it or choose another --name")
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    metadata = "".join(f'    endpoint = "{endpoint}"\n' for endpoint in endpoints)
    curve = f'curve\n    public-key = "{public.decode()}"\n'
    _write_new(
        public_path,
        f"#   ZeroMQ CURVE public certificate, written {stamp} by kvrouter keys generate\n"
        "#   Copy it into the --replica-curve-peer-keys-dir of every replica that should trust this one.\n\n"
        f"metadata\n{metadata}{curve}",
        0o644,
    )
    _write_new(
        secret_path,
        f"#   ZeroMQ CURVE **secret** certificate, written {stamp} by kvrouter keys generate\n"
        "#   Keep it on this replica only (--replica-curve-secret-key-file); never copy it elsewhere.\n\n"
        f'metadata\n{metadata}{curve}    secret-key = "{secret.decode()}"\n',
        0o600,
    )
    return public_path, secret_path


def _write_new(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


# -- the ZAP handler ----------------------------------------------------------------------------------


@attrs.define
class _KeyCheck:
    """pyzmq's credentials-provider interface for one ZAP domain: admits trusted keys, counts the rest."""

    trusted: TrustedPeers
    on_refused: Callable[[bytes], None]

    def callback(self, domain: str, key: bytes) -> bool:
        if self.trusted.allows(key):
            return True
        self.on_refused(key)
        return False


class _ZapGate:
    """The process's one ThreadAuthenticator: started with the first domain, then kept for the life of
    the process. (Stopping it would unbind ``inproc://zeromq.zap.01`` only once libzmq's reaper gets to
    it, so binding again at once can fail with EADDRINUSE; an idle handler costs one parked thread.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._authenticator: ThreadAuthenticator | None = None
        self._domains: set[str] = set()

    def open(self, domain: str, check: _KeyCheck) -> None:
        with self._lock:
            if domain in self._domains:
                raise ValueError(f"ZAP domain {domain!r} is already open")
            if self._authenticator is None:
                authenticator = ThreadAuthenticator(zmq_context(), log=logging.getLogger("kvrouter.replica.zap"))
                authenticator.start()
                self._authenticator = authenticator
            self._authenticator.configure_curve_callback(domain, check)
            self._domains.add(domain)

    def close(self, domain: str) -> None:
        with self._lock:
            if domain not in self._domains:
                return
            self._domains.discard(domain)
            assert self._authenticator is not None
            self._authenticator.credentials_providers.pop(domain, None)  # its handshakes now fail


_GATE: Final = _ZapGate()


@contextlib.contextmanager
def zap_domain(domain: str, trusted: TrustedPeers, on_refused: Callable[[bytes], None]) -> Iterator[None]:
    """While open, CURVE servers with ``ZAP_DOMAIN = domain`` admit only ``trusted`` client keys;
    ``on_refused(key)`` runs (on the ZAP thread) for every other one."""
    _GATE.open(domain, _KeyCheck(trusted, on_refused))
    try:
        yield
    finally:
        _GATE.close(domain)


class RefusalLog:
    """Logs each refused subscriber key once (up to ``LOGGED_REFUSALS_LIMIT`` keys), counts all."""

    def __init__(self, describe: str) -> None:
        self._describe = describe
        self._lock = threading.Lock()
        self._logged: set[bytes] = set()
        self.count = 0

    def __call__(self, key: bytes) -> None:
        with self._lock:
            self.count += 1
            if key in self._logged or len(self._logged) >= LOGGED_REFUSALS_LIMIT:
                return
            self._logged.add(key)
        log.warning(
            "%s: refused a subscriber with key %s (not in the peer keys directory); logged once per key",
            self._describe,
            key.decode("ascii", "replace"),
        )
