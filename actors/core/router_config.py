"""Router knobs that shape worker selection: defaults, ``DYN_*`` environment parsing, per-request overrides.

Spec §2.4, §2.5 and §2.9. Only the knobs the cost function and booking need live here; queueing, replica sync
and the rest belong to the shell. The caller passes ``os.environ`` to :func:`from_env`, so this module stays
pure (no ``os`` import).

Differences from Dynamo 1.6.1, on purpose:

* 1.6.1 silently ignores an environment value it cannot parse (``DYN_ROUTER_TEMPERATURE=abc`` leaves 0.0) and
  accepts out-of-range ones (a negative credit, a shared multiplier of 7). A typo there changes routing without
  a word, so :func:`from_env` raises one ``ValueError`` naming every bad variable instead.
* 1.6.1 validates ``router_config_override`` but then scores with the service-wide values (credit, scale,
  temperature and the prefill-tracking flag in the cost all ignore the override; only booking honours
  ``track_prefill_tokens``). :meth:`RouterConfigOverride.apply` applies every field, as the spec and newer
  Dynamo do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TypeVar

import attrs

_T = TypeVar("_T")

# Unified float grammar of Rust's ``f64::from_str`` minus inf/nan (rejected below as non-finite): no whitespace,
# no underscores, which Python's float() would quietly accept.
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NON_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
# The words 1.6.1 understands (case-insensitive, surrounding whitespace ignored); it ignores anything else.
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


@attrs.frozen
class RouterConfig:
    """Service-wide selection knobs with the reference's defaults (spec §2.9)."""

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

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RouterConfig:
        return from_env(env)


# (variable names, first set one wins; field; lower bound; upper bound or None)
_FLOAT_VARS: tuple[tuple[tuple[str, ...], str, float, float | None], ...] = (
    (("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",), "overlap_score_credit", 0.0, None),
    (("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",), "overlap_score_credit_decay", 0.0, None),
    (("DYN_ROUTER_PREFILL_LOAD_SCALE",), "prefill_load_scale", 0.0, None),
    (("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",), "decode_active_request_weight", 0.0, None),
    (("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",), "host_cache_hit_weight", 0.0, 1.0),
    (("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",), "disk_cache_hit_weight", 0.0, 1.0),
    (("DYN_ROUTER_TEMPERATURE",), "router_temperature", 0.0, None),
    (("DYN_SHARED_CACHE_MULTIPLIER",), "shared_cache_multiplier", 0.0, 1.0),
    (("DYN_ROUTER_TTL_SECS",), "router_ttl_secs", 0.0, None),
)
_BOOL_VARS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("DYN_ROUTER_USE_KV_EVENTS", "DYN_USE_KV_EVENTS"), "use_kv_events"),
    (("DYN_ROUTER_ASSUME_KV_REUSE",), "router_assume_kv_reuse"),
    (("DYN_ROUTER_TRACK_PREFILL_TOKENS",), "router_track_prefill_tokens"),
)
# Deprecated: x sets prefill_load_scale = x (over DYN_ROUTER_PREFILL_LOAD_SCALE), and x == 0 also zeroes the credit.
_WEIGHT_VARS = ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT")


def from_env(env: Mapping[str, str]) -> RouterConfig:
    """Build the config from ``DYN_*`` variables; unset or empty variables keep the default.

    Where two names exist (``DYN_ROUTER_USE_KV_EVENTS`` over ``DYN_USE_KV_EVENTS``, the two deprecated weight
    names), the first one set wins, as in 1.6.1. Raises ``ValueError`` listing every unparsable or out-of-range
    value.
    """
    values: dict[str, float | bool] = {}
    errors: list[str] = []
    for names, field, low, high in _FLOAT_VARS:
        found = _first_set(env, names)
        if found is not None:
            number = _parse_float(*found, low, high, errors)
            if number is not None:
                values[field] = number
    for names, field in _BOOL_VARS:
        found = _first_set(env, names)
        if found is not None:
            flag = _parse_bool(*found, errors)
            if flag is not None:
                values[field] = flag
    found = _first_set(env, _WEIGHT_VARS)
    if found is not None:
        weight = _parse_float(*found, 0.0, None, errors)
        if weight is not None:
            values["prefill_load_scale"] = weight
            if weight == 0.0:
                values["overlap_score_credit"] = 0.0
    if errors:
        raise ValueError("invalid router configuration: " + "; ".join(errors))
    return RouterConfig(**values)


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return name, value
    return None


def _parse_float(name: str, raw: str, low: float, high: float | None, errors: list[str]) -> float | None:
    if _NON_FINITE.fullmatch(raw):
        errors.append(f"{name}={raw!r} must be a finite number")
        return None
    if not _FLOAT.fullmatch(raw):
        errors.append(f"{name}={raw!r} is not a number")
        return None
    value = float(raw)
    if not math.isfinite(value):  # "1e999" overflows to inf
        errors.append(f"{name}={raw!r} must be a finite number")
        return None
    if value < low or (high is not None and value > high):
        bounds = f"between {low:g} and {high:g}" if high is not None else f">= {low:g}"
        errors.append(f"{name}={raw!r} must be {bounds}")
        return None
    return value + 0.0  # normalise -0.0


def _parse_bool(name: str, raw: str, errors: list[str]) -> bool | None:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    errors.append(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no or on/off)")
    return None


# 1.6.1's messages, checked in this order after the deprecated weight is folded in. It answers them with status
# 422 (the override is validated while the JSON body is deserialised), wrapped as "Failed to deserialize the JSON
# body into the target type: router_config_override: <message> at line 1 column N".
CREDIT_INVALID = "overlap_score_credit must be a finite, non-negative number"
SCALE_INVALID = "prefill_load_scale must be finite and non-negative"
TEMPERATURE_INVALID = "router_temperature must be finite and non-negative"
SHARED_MULTIPLIER_INVALID = "shared_cache_multiplier must be between 0 and 1"


@attrs.frozen
class RouterConfigOverride:
    """The per-request ``router_config_override`` (spec §2.5); ``None`` means "use the service value"."""

    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    overlap_score_weight: float | None = None  # deprecated alias, folded into the two above
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: float | None = None

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
        )


def _non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0


def _pick(override: _T | None, default: _T) -> _T:
    return default if override is None else override
