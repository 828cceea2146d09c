"""Router knobs that shape worker selection: defaults, ``DYN_*`` environment parsing, per-request overrides.

behaviour.md#cost, #selection-endpoints-and-overrides, #router-configuration. Only the knobs the cost function and
booking need live here; queueing, replica sync
and the rest belong to the shell. The caller passes ``os.environ`` to :func:`from_env` (and the command
line's flags, as text, to :func:`resolve`), so this module stays pure (no ``os`` import).

Differences from Dynamo 1.6.1, on purpose:

* 1.6.1 silently ignores an environment value it cannot parse (``DYN_ROUTER_TEMPERATURE=abc`` leaves 0.0) and
  accepts out-of-range ones (a negative credit, a shared multiplier of 7). A typo there changes routing without
  a word, so :func:`from_env` and :func:`resolve` raise one ``ValueError`` naming every bad variable or flag.
* 1.6.1 validates ``router_config_override`` but then scores with the service-wide values (credit, scale,
  temperature and the prefill-tracking flag in the cost all ignore the override; only booking honours
  ``track_prefill_tokens``). :meth:`RouterConfigOverride.apply` applies every field, as the spec and newer
  Dynamo do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from kvrouter.actors.core.worker_endpoints import EndpointAllowList

_T = TypeVar("_T")

# Unified float grammar of Rust's ``f64::from_str`` minus inf/nan (rejected below as non-finite): no whitespace,
# no underscores, which Python's float() would quietly accept.
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_NON_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
_INT = re.compile(r"[+-]?\d+", re.ASCII)
# The words 1.6.1 understands (case-insensitive, surrounding whitespace ignored); it ignores anything else.
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
KV_EVENTS_TIMEOUT_SECS = 15.0  # the default of --kv-events-timeout-secs (docs/workers.md#dead-kv-streams)


@attrs.frozen
class RouterConfig:
    """Service-wide selection knobs with the reference's defaults (behaviour.md#router-configuration)."""

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    router_temperature: float = 0.0
    use_kv_events: bool = True
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    shared_cache_multiplier: float = 0.0
    router_ttl_secs: float = 120.0
    # Approximate mode (behaviour.md#approximate-mode): predicted blocks beyond this many are pruned, oldest expiry
    # first, down to
    # router_prune_target_ratio of it.
    router_max_tree_size: int = 2**20
    router_prune_target_ratio: float = 0.8
    # Overload (behaviour.md#eligibility-busy-ranks-and-queueing); None disables each rule. See
    # actors/core/admission.py.
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: float | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    router_queue_threshold: float | None = None
    router_queue_policy: str = "fcfs"
    # Session affinity: None disables it (session_id is then ignored, as in 1.6.1 without the flag).
    session_affinity_ttl_secs: float | None = None
    # kvrouter's per-rank fallback in KV-event mode: a rank whose stream is absent, or silent this long after a
    # booking on it, is scored on its predicted (booked) blocks until its events resume. 0 disables it.
    kv_events_stale_secs: float = 10.0
    # kvrouter's: a rank with a KV listener (or a publisher on Dynamo's event plane) whose stream leaves a booking
    # unanswered this long is taken out of selection, its bookings freed, until its events resume
    # (actors/core/kv_liveness.py). 0 disables it.
    kv_events_timeout_secs: float = KV_EVENTS_TIMEOUT_SECS
    router_mode: str = "kv"  # see actors/core/routing_modes.py
    router_track_active_blocks: bool = True  # off: bookings hold no decode blocks (prefill-only pools)
    router_track_output_blocks: bool = False  # on: output blocks decay by expected_output_tokens
    # Not a selection knob but the catalog's policy, kept here so it reaches every place a selection service is
    # built: the hosts worker endpoints may name (--worker-endpoint-allow; None: any host).
    worker_endpoint_allow: EndpointAllowList | None = None

    @property
    def queueing(self) -> bool:
        """Whether requests wait (instead of a 429) while every eligible rank is busy."""
        return self.router_queue_threshold is not None

    @property
    def affinity_ttl_ns(self) -> int:
        return 0 if self.session_affinity_ttl_secs is None else int(self.session_affinity_ttl_secs * 1e9)

    @property
    def prune_target(self) -> int:
        """How many predicted blocks a prune leaves (at least one fewer than the maximum)."""
        limit = self.router_max_tree_size
        return min(limit - 1, int(limit * self.router_prune_target_ratio)) if limit > 0 else 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RouterConfig:
        return from_env(env)


# A setting as the operator wrote it: (where it came from -- a variable or flag name --, its raw text).
Setting = tuple[str, str]

# field -> (lower bound, upper bound or None)
_FLOAT_FIELDS: dict[str, tuple[float, float | None]] = {
    "overlap_score_credit": (0.0, None),
    "overlap_score_credit_decay": (0.0, None),
    "prefill_load_scale": (0.0, None),
    "decode_active_request_weight": (0.0, None),
    "host_cache_hit_weight": (0.0, 1.0),
    "disk_cache_hit_weight": (0.0, 1.0),
    "router_temperature": (0.0, None),
    "shared_cache_multiplier": (0.0, 1.0),
    "router_ttl_secs": (0.0, None),
    "router_prune_target_ratio": (0.0, 1.0),
    "kv_events_stale_secs": (0.0, None),
    "kv_events_timeout_secs": (0.0, None),
}
# Optional numbers: unset means the rule is off. Same grammar and bounds as the fields above.
_OPTIONAL_FLOAT_FIELDS: dict[str, tuple[float, float | None]] = {
    "active_decode_blocks_threshold": (0.0, 1.0),
    "active_prefill_tokens_threshold": (0.0, None),
    "active_prefill_tokens_threshold_frac": (0.0, None),
    "router_queue_threshold": (0.0, None),
    "session_affinity_ttl_secs": (0.0, None),
}
_INT_FIELDS: dict[str, tuple[int, int]] = {"router_max_tree_size": (1, 2**48)}
QUEUE_POLICIES = ("fcfs", "lcfs", "wspt")
_CHOICE_FIELDS: dict[str, tuple[str, ...]] = {"router_queue_policy": QUEUE_POLICIES}
_BOOL_FIELDS = frozenset(
    {
        "use_kv_events",
        "router_assume_kv_reuse",
        "router_track_prefill_tokens",
        "router_track_active_blocks",
        "router_track_output_blocks",
    }
)
_MODE_FIELD = "router_mode"
# Spelled as Dynamo's --router-mode does (dashes); underscores are accepted too.
ROUTER_MODES = ("kv", "round_robin", "random", "direct", "least_loaded", "kv_ttft")
# Deprecated: x sets prefill_load_scale = x (over the scale given alongside it), and x == 0 also zeroes the credit.
OVERLAP_SCORE_WEIGHT = "overlap_score_weight"

# field -> variable names, the first one set wins
_ENV_NAMES: dict[str, tuple[str, ...]] = {
    "overlap_score_credit": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",),
    "overlap_score_credit_decay": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",),
    "prefill_load_scale": ("DYN_ROUTER_PREFILL_LOAD_SCALE",),
    "decode_active_request_weight": ("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",),
    "host_cache_hit_weight": ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",),
    "disk_cache_hit_weight": ("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",),
    "router_temperature": ("DYN_ROUTER_TEMPERATURE",),
    "shared_cache_multiplier": ("DYN_SHARED_CACHE_MULTIPLIER",),
    "router_ttl_secs": ("DYN_ROUTER_TTL_SECS",),
    "router_max_tree_size": ("DYN_ROUTER_MAX_TREE_SIZE",),
    "router_prune_target_ratio": ("DYN_ROUTER_PRUNE_TARGET_RATIO",),
    "kv_events_stale_secs": ("DYN_ROUTER_KV_EVENTS_STALE_SECS",),
    "kv_events_timeout_secs": ("DYN_ROUTER_KV_EVENTS_TIMEOUT_SECS",),
    "active_decode_blocks_threshold": ("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",),
    "active_prefill_tokens_threshold": ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",),
    "active_prefill_tokens_threshold_frac": ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",),
    "router_queue_threshold": ("DYN_ROUTER_QUEUE_THRESHOLD",),
    "router_queue_policy": ("DYN_ROUTER_QUEUE_POLICY",),
    "session_affinity_ttl_secs": ("DYN_SESSION_AFFINITY_TTL_SECS",),
    "use_kv_events": ("DYN_ROUTER_USE_KV_EVENTS", "DYN_USE_KV_EVENTS"),
    "router_assume_kv_reuse": ("DYN_ROUTER_ASSUME_KV_REUSE",),
    "router_track_prefill_tokens": ("DYN_ROUTER_TRACK_PREFILL_TOKENS",),
    "router_track_active_blocks": ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS",),
    "router_track_output_blocks": ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS",),
    _MODE_FIELD: ("DYN_ROUTER_MODE",),
    OVERLAP_SCORE_WEIGHT: ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT"),
}


class InvalidSettings(ValueError):
    """Settings that do not parse or are out of range; ``problems`` names each one (variable or flag)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid router configuration: " + "; ".join(problems))
        self.problems = tuple(problems)


def from_env(env: Mapping[str, str]) -> RouterConfig:
    """Build the config from ``DYN_*`` variables; unset or empty variables keep the default.

    Where two names exist (``DYN_ROUTER_USE_KV_EVENTS`` over ``DYN_USE_KV_EVENTS``, the two deprecated weight
    names), the first one set wins, as in 1.6.1. Raises :class:`InvalidSettings` (a ``ValueError``) listing
    every unparsable or out-of-range value.
    """
    return resolve(env_settings(env))


def env_settings(env: Mapping[str, str]) -> dict[str, Setting]:
    """The ``DYN_*`` variables that are set (non-empty), by field, as raw text for :func:`resolve`."""
    found: dict[str, Setting] = {}
    for field, names in _ENV_NAMES.items():
        for name in names:
            value = env.get(name)
            if value is not None and value.strip():
                found[field] = (name, value)
                break
    return found


def resolve(*layers: Mapping[str, Setting]) -> RouterConfig:
    """The config from layers of raw settings by field (e.g. the environment, then command-line flags).

    Every value goes through the same rules whatever its source (the environment's grammar: finite numbers
    within the field's bounds, 1.6.1's boolean words), so a flag cannot smuggle in what a variable may not.
    A later layer wins field by field; within one layer the deprecated ``overlap_score_weight`` wins over
    ``prefill_load_scale`` and, when zero, zeroes ``overlap_score_credit``. Raises :class:`InvalidSettings`
    naming every bad value of every layer.
    """
    # Keyword arguments by field name: _parse_layer gives each field a value of its type, which mypy cannot
    # see through a name known only at run time.
    values: dict[str, Any] = {}
    problems: list[str] = []
    labels: dict[str, str] = {}
    for layer in layers:
        values.update(_parse_layer(layer, problems))
        labels.update({field: label for field, (label, _) in layer.items()})
    if problems:
        raise InvalidSettings(problems)
    config = RouterConfig(**values)
    problem = config_problem(config)
    if problem:
        involved = ("router_track_output_blocks", "router_track_active_blocks")
        named = ", ".join(labels[field] for field in involved if field in labels)
        raise InvalidSettings([f"{problem} ({named})" if named else problem])
    return config


def config_problem(config: RouterConfig) -> str | None:
    """A combination of knobs that cannot work together (behaviour.md#router-configuration's validation), or None."""
    if config.router_track_output_blocks and not config.router_track_active_blocks:
        return "output-block tracking requires active-block tracking"
    return None


def parse_router_mode(raw: str) -> str | None:
    """The canonical router mode for ``raw`` (``round-robin`` or ``round_robin``, any case), else None."""
    name = raw.strip().lower().replace("-", "_")
    return name if name in ROUTER_MODES else None


def _parse_layer(layer: Mapping[str, Setting], problems: list[str]) -> dict[str, float | bool | str | int]:
    values: dict[str, float | bool | str | int] = {}
    for field, (label, raw) in layer.items():
        if field == _MODE_FIELD:
            mode = parse_router_mode(raw)
            if mode is None:
                problems.append(f"{label}={raw!r} is not a router mode (use {', '.join(ROUTER_MODES)})")
            else:
                values[field] = mode
        elif field in _OPTIONAL_FLOAT_FIELDS:
            low, high = _OPTIONAL_FLOAT_FIELDS[field]
            number = parse_float(label, raw, low, high, problems)
            if number is not None:
                values[field] = number
        elif field in _INT_FIELDS:
            low_int, high_int = _INT_FIELDS[field]
            whole = parse_int(label, raw.strip(), low_int, high_int, problems)
            if whole is not None:
                values[field] = whole
        elif field in _CHOICE_FIELDS:
            word = raw.strip().lower()
            if word in _CHOICE_FIELDS[field]:
                values[field] = word
            else:
                problems.append(f"{label}={raw!r} must be one of {', '.join(_CHOICE_FIELDS[field])}")
        elif field in _BOOL_FIELDS:
            flag = parse_bool(label, raw, problems)
            if flag is not None:
                values[field] = flag
        elif field in _FLOAT_FIELDS or field == OVERLAP_SCORE_WEIGHT:
            low, high = _FLOAT_FIELDS.get(field, (0.0, None))
            number = parse_float(label, raw, low, high, problems)
            if number is not None:
                values[field] = number
        else:
            raise KeyError(f"unknown router setting {field!r}")
    weight = values.pop(OVERLAP_SCORE_WEIGHT, None)
    if isinstance(weight, float):
        values["prefill_load_scale"] = weight
        if weight == 0.0:
            values["overlap_score_credit"] = 0.0
    return values


def parse_float(label: str, raw: str, low: float, high: float | None, problems: list[str]) -> float | None:
    """``raw`` as a finite number in [low, high]; otherwise ``None`` and one problem naming ``label``."""
    if _NON_FINITE.fullmatch(raw):
        problems.append(f"{label}={raw!r} must be a finite number")
        return None
    if not _FLOAT.fullmatch(raw):
        problems.append(f"{label}={raw!r} is not a number")
        return None
    value = float(raw)
    if not math.isfinite(value):  # "1e999" overflows to inf
        problems.append(f"{label}={raw!r} must be a finite number")
        return None
    if value < low or (high is not None and value > high):
        problems.append(f"{label}={raw!r} must be {_bounds(low, high)}")
        return None
    return value + 0.0  # normalise -0.0


def parse_int(label: str, raw: str, low: int, high: int, problems: list[str]) -> int | None:
    """``raw`` as a decimal integer in [low, high]; otherwise ``None`` and one problem naming ``label``."""
    if not _INT.fullmatch(raw):
        problems.append(f"{label}={raw!r} is not a whole number")
        return None
    # (int() refuses 4,300+ digits; anything with more digits than the bounds is out of range anyway)
    value = int(raw) if len(raw) <= max(len(str(low)), len(str(high))) + 1 else None
    if value is None or not low <= value <= high:
        problems.append(f"{label}={raw!r} must be {_bounds(low, high)}")
        return None
    return value


def parse_bool(label: str, raw: str, problems: list[str]) -> bool | None:
    """``raw`` as one of 1.6.1's boolean words; otherwise ``None`` and one problem naming ``label``."""
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    problems.append(f"{label}={raw!r} is not a boolean (use true/false, 1/0, yes/no or on/off)")
    return None


def _bounds(low: float, high: float | None) -> str:
    return f"between {_show(low)} and {_show(high)}" if high is not None else f">= {_show(low)}"


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


# 1.6.1's messages, checked in this order after the deprecated weight is folded in. It answers them with status
# 422 (the override is validated while the JSON body is deserialised), wrapped as "Failed to deserialize the JSON
# body into the target type: router_config_override: <message> at line 1 column N".
CREDIT_INVALID = "overlap_score_credit must be a finite, non-negative number"
SCALE_INVALID = "prefill_load_scale must be finite and non-negative"
TEMPERATURE_INVALID = "router_temperature must be finite and non-negative"
SHARED_MULTIPLIER_INVALID = "shared_cache_multiplier must be between 0 and 1"


@attrs.frozen
class RouterConfigOverride:
    """The per-request ``router_config_override`` (behaviour.md#selection-endpoints-and-overrides); ``None`` means "use
    the service value"."""

    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    overlap_score_weight: float | None = None  # deprecated alias, folded into the two above
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: float | None = None
    track_active_blocks: bool | None = None  # kvrouter's: not in 1.6.1's override
    track_output_blocks: bool | None = None  # kvrouter's: not in 1.6.1's override

    def credit_and_scale(self) -> tuple[float | None, float | None]:
        """Credit and scale after the deprecated weight: weight x sets scale x, and x == 0 also zeroes credit.

        The weight wins over explicit fields, so ``{"overlap_score_weight": 0, "overlap_score_credit": -1}`` is
        valid (credit becomes 0) and ``{"overlap_score_weight": -1, "prefill_load_scale": 2}`` is not.
        """
        credit, scale = self.overlap_score_credit, self.prefill_load_scale
        if self.overlap_score_weight is not None:
            scale = self.overlap_score_weight
            if self.overlap_score_weight == 0.0:
                credit = 0.0
        return credit, scale

    def validate(self) -> str | None:
        """The first violated rule's message (1.6.1's text and order), or ``None`` when the override is usable.

        A credit above 1 is accepted, as in 1.6.1 (newer Dynamo caps it at 1).
        """
        credit, scale = self.credit_and_scale()
        if credit is not None and not _non_negative(credit):
            return CREDIT_INVALID
        if scale is not None and not _non_negative(scale):
            return SCALE_INVALID
        if self.router_temperature is not None and not _non_negative(self.router_temperature):
            return TEMPERATURE_INVALID
        if self.shared_cache_multiplier is not None and not 0.0 <= self.shared_cache_multiplier <= 1.0:
            return SHARED_MULTIPLIER_INVALID
        return None

    def apply(self, config: RouterConfig) -> RouterConfig:
        """``config`` with this override's fields in place; call :meth:`validate` first."""
        credit, scale = self.credit_and_scale()
        return attrs.evolve(
            config,
            overlap_score_credit=_pick(credit, config.overlap_score_credit),
            prefill_load_scale=_pick(scale, config.prefill_load_scale),
            router_temperature=_pick(self.router_temperature, config.router_temperature),
            router_assume_kv_reuse=_pick(self.assume_kv_reuse, config.router_assume_kv_reuse),
            router_track_prefill_tokens=_pick(self.track_prefill_tokens, config.router_track_prefill_tokens),
            shared_cache_multiplier=_pick(self.shared_cache_multiplier, config.shared_cache_multiplier),
            router_track_active_blocks=_pick(self.track_active_blocks, config.router_track_active_blocks),
            router_track_output_blocks=_pick(self.track_output_blocks, config.router_track_output_blocks),
        )


def _non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0


def _pick(override: _T | None, default: _T) -> _T:
    return default if override is None else override
