"""Fault plans for cluster simulations (``--faults SPEC``), parsed into plain data.

A spec is a ``;``-separated list; times are virtual, in ms, or with an ``ms``/``s`` suffix:

``worker-crash@T:worker=W``
    Worker W's engines lose everything at T (running and queued requests fail and the client releases
    their reservations; the KV cache is cleared) and come straight back with their KV-event sequence
    reset to 0, which the router's listener takes as a publisher restart (the rank's blocks are dropped).
``cache-reset@T:worker=W``
    Worker W resets its prefix cache (vLLM's ``reset_prefix_cache``) the first time it is idle at or after T:
    every cached block is dropped and one ``AllBlocksCleared`` is published.
``kv-loss@T:worker=W,batches=N[,replay=yes|no]``
    The next N KV-event batches of worker W published from T on are lost on the way to every router.
    With ``replay=yes`` (default) the listener sees the sequence gap at the next batch and fetches the
    missing ones from the worker's replay buffer, as the KV listener does; ``no`` leaves the index stale.
``kv-no-removals@T:worker=W``
    From T on, worker W publishes no ``BlockRemoved`` events (a publisher that loses its evictions): the
    router goes on predicting blocks the worker no longer holds, and the ``cached_tokens`` its clients report
    fall short of the predictions.
``router-crash@T[:router=R,down=D]``
    Router replica R (default 0) dies at T and restarts D later (default 1s) from its journal alone.
    Meanwhile clients send new requests to another replica, or hold them until it is back; lifecycle
    calls for requests it booked wait for it; KV batches it missed are replayed from each worker after
    its journaled watermark, as a restarted listener does.
``sync-drop=P``, ``sync-delay=D``, ``sync-reorder=P``, ``sync-until=T``
    Replica-sync messages between routers (``--replicas`` >= 2): each is lost with probability P,
    delayed by D (uniformly 0..2D), or held back past the next one with probability P, until T (default:
    the whole run). Replica sync is best-effort (as in Dynamo 1.6.1): a lost free leaves a stale load on
    a peer until the stale-request expiry (300 s) removes it, so the final agreement check runs after
    that horizon.

Every random choice of a fault comes from ``Random(f"{seed}:faults")``.
"""

from __future__ import annotations

import math

import attrs


class FaultSpecError(ValueError):
    pass


@attrs.frozen
class WorkerCrash:
    at_ms: float
    worker: int


@attrs.frozen
class CacheReset:
    at_ms: float
    worker: int


@attrs.frozen
class KvLoss:
    at_ms: float
    worker: int
    batches: int
    replay: bool = True


@attrs.frozen
class KvNoRemovals:
    at_ms: float
    worker: int


@attrs.frozen
class RouterCrash:
    at_ms: float
    router: int = 0
    down_ms: float = 1000.0


@attrs.frozen
class SyncFaults:
    drop: float = 0.0
    delay_ms: float = 0.0
    reorder: float = 0.0
    until_ms: float = math.inf

    @property
    def active(self) -> bool:
        return self.drop > 0 or self.delay_ms > 0 or self.reorder > 0


TimedFault = WorkerCrash | CacheReset | KvLoss | KvNoRemovals | RouterCrash


@attrs.frozen
class FaultPlan:
    timed: tuple[TimedFault, ...] = ()
    sync: SyncFaults = SyncFaults()

    @property
    def empty(self) -> bool:
        return not self.timed and not self.sync.active


NO_FAULTS = FaultPlan()


def parse_time(text: str, what: str) -> float:
    raw = text.strip().lower()
    scale = 1.0
    if raw.endswith("ms"):
        raw = raw[:-2]
    elif raw.endswith("s"):
        raw, scale = raw[:-1], 1000.0
    try:
        value = float(raw) * scale
    except ValueError:
        raise FaultSpecError(f"{what}: {text!r} is not a time (e.g. 1500, 1500ms, 1.5s)") from None
    if not (value >= 0 and math.isfinite(value)):
        raise FaultSpecError(f"{what}: {text!r} must be a finite time >= 0")
    return value


def _probability(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"{what}: {text!r} is not a probability") from None
    if not 0.0 <= value <= 1.0:
        raise FaultSpecError(f"{what}: {text!r} must be between 0 and 1")
    return value


def _int(text: str, what: str, minimum: int) -> int:
    if not text.strip().isdigit() or int(text) < minimum:
        raise FaultSpecError(f"{what}: {text!r} must be an integer >= {minimum}")
    return int(text)


def parse_faults(spec: str | None) -> FaultPlan:
    """The plan a ``--faults`` spec describes; raises ``FaultSpecError`` naming the bad item."""
    if not spec or not spec.strip():
        return NO_FAULTS
    timed: list[TimedFault] = []
    sync: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        if item.startswith("sync-"):
            key, sep, value = item.partition("=")
            if not sep:
                raise FaultSpecError(f"{item}: expected {key}=VALUE")
            if key == "sync-drop":
                sync["drop"] = _probability(value, item)
            elif key == "sync-reorder":
                sync["reorder"] = _probability(value, item)
            elif key == "sync-delay":
                sync["delay_ms"] = parse_time(value, item)
            elif key == "sync-until":
                sync["until_ms"] = parse_time(value, item)
            else:
                known = "sync-drop, sync-delay, sync-reorder, sync-until"
                raise FaultSpecError(f"{item}: unknown replica-sync fault ({known})")
            continue
        head, _, params_text = item.partition(":")
        kind, at_sep, at_text = head.partition("@")
        if not at_sep:
            raise FaultSpecError(f"{item}: expected KIND@TIME[:key=value,...]")
        at = parse_time(at_text, item)
        params: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in params_text.split(","))):
            key, sep, value = pair.partition("=")
            if not sep:
                raise FaultSpecError(f"{item}: expected key=value, got {pair!r}")
            params[key.strip()] = value.strip()
        timed.append(_timed(kind.strip(), at, params, item))
    return FaultPlan(tuple(sorted(timed, key=lambda f: f.at_ms)), SyncFaults(**sync))


def _timed(kind: str, at: float, params: dict[str, str], item: str) -> TimedFault:
    def take(allowed: set[str]) -> None:
        unknown = set(params) - allowed
        if unknown:
            raise FaultSpecError(f"{item}: unknown parameter(s) {', '.join(sorted(unknown))}")

    if kind == "worker-crash":
        take({"worker"})
        if "worker" not in params:
            raise FaultSpecError(f"{item}: worker=W is required")
        return WorkerCrash(at, _int(params["worker"], item, 1))
    if kind == "cache-reset":
        take({"worker"})
        if "worker" not in params:
            raise FaultSpecError(f"{item}: worker=W is required")
        return CacheReset(at, _int(params["worker"], item, 1))
    if kind == "kv-loss":
        take({"worker", "batches", "replay"})
        if "worker" not in params:
            raise FaultSpecError(f"{item}: worker=W is required")
        replay = params.get("replay", "yes").lower()
        if replay not in ("yes", "no"):
            raise FaultSpecError(f"{item}: replay must be yes or no")
        return KvLoss(at, _int(params["worker"], item, 1), _int(params.get("batches", "1"), item, 1), replay == "yes")
    if kind == "kv-no-removals":
        take({"worker"})
        if "worker" not in params:
            raise FaultSpecError(f"{item}: worker=W is required")
        return KvNoRemovals(at, _int(params["worker"], item, 1))
    if kind == "router-crash":
        take({"router", "down"})
        down = parse_time(params["down"], item) if "down" in params else 1000.0
        return RouterCrash(at, _int(params.get("router", "0"), item, 0), down)
    known = "worker-crash, cache-reset, kv-loss, kv-no-removals, router-crash, sync-*"
    raise FaultSpecError(f"{item}: unknown fault {kind!r} ({known})")
