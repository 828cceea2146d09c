"""RouterConfig defaults, DYN_* parsing and per-request overrides.

Facts marked "verified against 1.6.1" come from starting ``python -m dynamo.select_service`` with the environment
shown and reading its "KvRouterConfig initialized (DYN_* env overrides applied)" log line, or from posting the
override to ``/select`` and reading the error.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.router_config import (
    CREDIT_INVALID,
    SCALE_INVALID,
    SHARED_MULTIPLIER_INVALID,
    TEMPERATURE_INVALID,
    InvalidSettings,
    RouterConfig,
    RouterConfigOverride,
    env_settings,
    from_env,
    parse_int,
    resolve,
)


def test_defaults_are_the_reference_defaults() -> None:
    # behaviour.md#router-configuration; verified against 1.6.1 (startup log with an empty environment).
    assert attrs.asdict(RouterConfig()) == {
        "overlap_score_credit": 1.0,
        "overlap_score_credit_decay": 0.0,
        "prefill_load_scale": 1.0,
        "decode_active_request_weight": 0.0,
        "host_cache_hit_weight": 0.75,
        "disk_cache_hit_weight": 0.25,
        "router_temperature": 0.0,
        "use_kv_events": True,
        "router_assume_kv_reuse": True,
        "router_track_prefill_tokens": True,
        "shared_cache_multiplier": 0.0,
        "router_ttl_secs": 120.0,
        "router_max_tree_size": 2**20,
        "router_prune_target_ratio": 0.8,
        "active_decode_blocks_threshold": None,
        "active_prefill_tokens_threshold": None,
        "active_prefill_tokens_threshold_frac": None,
        "router_queue_threshold": None,
        "router_queue_policy": "fcfs",
        "session_affinity_ttl_secs": None,
        "kv_events_stale_secs": 10.0,  # kvrouter's own (per-rank fallback); not a 1.6.1 knob
        "kv_events_timeout_secs": 15.0,  # kvrouter's own (a silent rank leaves selection); not a 1.6.1 knob
        "router_mode": "kv",  # behaviour.md#router-configuration and the seed: kv routing, active blocks tracked,
        # output blocks not
        "router_track_active_blocks": True,
        "router_track_output_blocks": False,
        "worker_endpoint_allow": None,  # kvrouter's catalog policy (--worker-endpoint-allow): any host
    }


def test_empty_environment_gives_defaults() -> None:
    assert from_env({}) == RouterConfig() == RouterConfig.from_env({"UNRELATED": "x"})


def test_every_variable_name() -> None:
    # verified against 1.6.1: each of these names moved its field in the startup log.
    env = {
        "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "2.5",
        "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY": "0.5",
        "DYN_ROUTER_PREFILL_LOAD_SCALE": "1.5",
        "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT": "0.1",
        "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT": "0.5",
        "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT": "0.125",
        "DYN_ROUTER_TEMPERATURE": "1e-1",
        "DYN_USE_KV_EVENTS": "false",
        "DYN_ROUTER_ASSUME_KV_REUSE": "no",
        "DYN_ROUTER_TRACK_PREFILL_TOKENS": "0",
        "DYN_SHARED_CACHE_MULTIPLIER": "0.5",
        "DYN_ROUTER_TTL_SECS": "30",
    }
    assert from_env(env) == RouterConfig(
        overlap_score_credit=2.5,
        overlap_score_credit_decay=0.5,
        prefill_load_scale=1.5,
        decode_active_request_weight=0.1,
        host_cache_hit_weight=0.5,
        disk_cache_hit_weight=0.125,
        router_temperature=0.1,
        use_kv_events=False,
        router_assume_kv_reuse=False,
        router_track_prefill_tokens=False,
        shared_cache_multiplier=0.5,
        router_ttl_secs=30.0,
    )


@pytest.mark.parametrize(
    ("env", "credit", "scale"),
    [
        # All verified against 1.6.1 (startup log).
        ({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "2"}, 1.0, 2.0),
        ({"DYN_OVERLAP_SCORE_WEIGHT": "0"}, 0.0, 0.0),
        # weight 0 zeroes an explicit credit
        ({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "0", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0.5"}, 0.0, 0.0),
        # the DYN_ROUTER_ name wins over DYN_OVERLAP_SCORE_WEIGHT
        ({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "3", "DYN_OVERLAP_SCORE_WEIGHT": "0"}, 1.0, 3.0),
        # the weight wins over the canonical scale
        ({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "3", "DYN_ROUTER_PREFILL_LOAD_SCALE": "5"}, 1.0, 3.0),
        # an empty first name falls through to the second
        ({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "", "DYN_OVERLAP_SCORE_WEIGHT": "2"}, 1.0, 2.0),
        ({"DYN_ROUTER_PREFILL_LOAD_SCALE": "2", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0"}, 0.0, 2.0),
    ],
)
def test_deprecated_overlap_score_weight(env: dict[str, str], credit: float, scale: float) -> None:
    config = from_env(env)
    assert (config.overlap_score_credit, config.prefill_load_scale) == (credit, scale)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # verified against 1.6.1: DYN_ROUTER_USE_KV_EVENTS wins over DYN_USE_KV_EVENTS.
        ({"DYN_ROUTER_USE_KV_EVENTS": "false"}, False),
        ({"DYN_ROUTER_USE_KV_EVENTS": "false", "DYN_USE_KV_EVENTS": "true"}, False),
        ({"DYN_ROUTER_USE_KV_EVENTS": "true", "DYN_USE_KV_EVENTS": "false"}, True),
        ({"DYN_USE_KV_EVENTS": "false"}, False),
    ],
)
def test_use_kv_events_names(env: dict[str, str], expected: bool) -> None:
    assert from_env(env).use_kv_events is expected


# verified against 1.6.1: these words, in any case and with surrounding spaces, are the booleans it understands.
@pytest.mark.parametrize("word", ["false", "FALSE", "False", "0", "no", "NO", "off", "OFF", " false"])
def test_false_words(word: str) -> None:
    assert from_env({"DYN_ROUTER_ASSUME_KV_REUSE": word}).router_assume_kv_reuse is False


@pytest.mark.parametrize("word", ["true", "TRUE", "1", "yes", "Yes", "on"])
def test_true_words(word: str) -> None:
    assert from_env({"DYN_ROUTER_TRACK_PREFILL_TOKENS": "false", "DYN_ROUTER_ASSUME_KV_REUSE": word}) == RouterConfig(
        router_track_prefill_tokens=False
    )


# 1.6.1 ignores all of these (the field keeps its default, verified); kvrouter refuses to start instead.
@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("DYN_ROUTER_ASSUME_KV_REUSE", "garbage", "is not a boolean"),
        ("DYN_ROUTER_ASSUME_KV_REUSE", "y", "is not a boolean"),
        ("DYN_ROUTER_ASSUME_KV_REUSE", "t", "is not a boolean"),
        ("DYN_ROUTER_TEMPERATURE", "abc", "is not a number"),
        ("DYN_ROUTER_TEMPERATURE", " 0.5", "is not a number"),
        ("DYN_ROUTER_TEMPERATURE", "0.5 ", "is not a number"),
        ("DYN_ROUTER_TEMPERATURE", "1_0", "is not a number"),
        ("DYN_ROUTER_TTL_SECS", "abc", "is not a number"),
        ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "abc", "is not a number"),
    ],
)
def test_unparsable_values_are_refused(name: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        from_env({name: raw})
    assert name in str(caught.value)


# 1.6.1 accepts all of these as given (verified: credit -1.0, temperature inf/NaN, shared 7.0, ttl -3.0 in the log).
@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "-1", "must be >= 0"),
        ("DYN_ROUTER_TEMPERATURE", "-1", "must be >= 0"),
        ("DYN_ROUTER_TEMPERATURE", "inf", "must be a finite number"),
        ("DYN_ROUTER_TEMPERATURE", "NaN", "must be a finite number"),
        ("DYN_ROUTER_TEMPERATURE", "1e999", "must be a finite number"),
        ("DYN_SHARED_CACHE_MULTIPLIER", "7", "must be between 0 and 1"),
        ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", "1.5", "must be between 0 and 1"),
        ("DYN_ROUTER_TTL_SECS", "-3", "must be >= 0"),
        ("DYN_OVERLAP_SCORE_WEIGHT", "-2", "must be >= 0"),
    ],
)
def test_out_of_range_values_are_refused(name: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_env({name: raw})


@pytest.mark.parametrize(("raw", "value"), [("1e-1", 0.1), ("+2", 2.0), (".5", 0.5), ("5", 5.0), ("1.", 1.0)])
def test_float_syntax(raw: str, value: float) -> None:
    # verified against 1.6.1 for 1e-1, +2, .5 and 5.
    assert from_env({"DYN_ROUTER_TEMPERATURE": raw}).router_temperature == value


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        from_env({"DYN_ROUTER_TEMPERATURE": "hot", "DYN_USE_KV_EVENTS": "maybe", "DYN_ROUTER_TTL_SECS": "-1"})
    text = str(caught.value)
    assert "DYN_ROUTER_TEMPERATURE='hot'" in text
    assert "DYN_USE_KV_EVENTS='maybe'" in text
    assert "DYN_ROUTER_TTL_SECS='-1'" in text


def test_negative_zero_weight_counts_as_zero() -> None:
    # verified against 1.6.1: DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT=-0.0 zeroes the credit.
    config = from_env({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "-0.0"})
    assert config.overlap_score_credit == 0.0
    assert math.copysign(1.0, config.prefill_load_scale) == 1.0


# Override validation: message text and precedence verified against 1.6.1 by POST /select with
# {"model_name":"m","token_ids":[1,2,3,4],"router_config_override":{...}}. 1.6.1 answers status 422 with
# "Failed to deserialize the JSON body into the target type: router_config_override: <message> at line 1 column N",
# before looking up the partition (an unknown model still gets the 422), on /select, /select_and_reserve,
# /potential_loads and /overlap_scores alike.
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"overlap_score_credit": -1}, CREDIT_INVALID),
        ({"overlap_score_credit": 2}, None),  # 1.6.1 accepts credits above 1 (newer source caps at 1)
        ({"overlap_score_credit": 1.5}, None),
        ({"overlap_score_credit": -0.0}, None),
        ({"shared_cache_multiplier": 2}, SHARED_MULTIPLIER_INVALID),
        ({"shared_cache_multiplier": -0.5}, SHARED_MULTIPLIER_INVALID),
        ({"shared_cache_multiplier": 1.0000001}, SHARED_MULTIPLIER_INVALID),
        ({"shared_cache_multiplier": 1}, None),
        ({"shared_cache_multiplier": 0}, None),
        ({"prefill_load_scale": -1}, SCALE_INVALID),
        ({"router_temperature": -1}, TEMPERATURE_INVALID),
        ({"router_temperature": 1e308}, None),
        ({"overlap_score_weight": -1}, SCALE_INVALID),  # the weight becomes the scale before validation
        ({"overlap_score_weight": 0}, None),
        # precedence: credit, then scale, then temperature, then shared multiplier
        ({"overlap_score_credit": -1, "prefill_load_scale": -1}, CREDIT_INVALID),
        (
            {
                "overlap_score_credit": -1,
                "shared_cache_multiplier": 2,
                "router_temperature": -1,
                "prefill_load_scale": -2,
            },
            CREDIT_INVALID,
        ),
        ({"prefill_load_scale": -1, "router_temperature": -1}, SCALE_INVALID),
        ({"prefill_load_scale": -1, "shared_cache_multiplier": 2}, SCALE_INVALID),
        ({"shared_cache_multiplier": 2, "router_temperature": -1}, TEMPERATURE_INVALID),
        ({"overlap_score_weight": -1, "overlap_score_credit": -1}, CREDIT_INVALID),
        # the weight overrides the explicit fields before they are checked
        ({"overlap_score_weight": 2, "prefill_load_scale": -1}, None),
        ({"overlap_score_weight": -1, "prefill_load_scale": 2}, SCALE_INVALID),
        ({"overlap_score_weight": 0, "overlap_score_credit": -1}, None),
        ({}, None),
    ],
)
def test_override_validation(override: dict[str, float], message: str | None) -> None:
    assert RouterConfigOverride(**override).validate() == message


def test_override_messages_are_the_reference_text() -> None:
    # verified against 1.6.1 (the text inside its 422 error).
    assert CREDIT_INVALID == "overlap_score_credit must be a finite, non-negative number"
    assert SCALE_INVALID == "prefill_load_scale must be finite and non-negative"
    assert TEMPERATURE_INVALID == "router_temperature must be finite and non-negative"
    assert SHARED_MULTIPLIER_INVALID == "shared_cache_multiplier must be between 0 and 1"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_override_rejects_non_finite(bad: float) -> None:
    assert RouterConfigOverride(overlap_score_credit=bad).validate() == CREDIT_INVALID
    assert RouterConfigOverride(prefill_load_scale=bad).validate() == SCALE_INVALID
    assert RouterConfigOverride(router_temperature=bad).validate() == TEMPERATURE_INVALID
    assert RouterConfigOverride(shared_cache_multiplier=bad).validate() == SHARED_MULTIPLIER_INVALID


def test_empty_override_changes_nothing() -> None:
    config = RouterConfig(overlap_score_credit=0.5, router_temperature=2.0, router_assume_kv_reuse=False)
    assert RouterConfigOverride().apply(config) == config


def test_override_applies_every_field() -> None:
    override = RouterConfigOverride(
        overlap_score_credit=0.25,
        prefill_load_scale=3.0,
        router_temperature=0.5,
        assume_kv_reuse=False,
        track_prefill_tokens=False,
        shared_cache_multiplier=0.5,
    )
    assert override.apply(RouterConfig(host_cache_hit_weight=0.5)) == RouterConfig(
        overlap_score_credit=0.25,
        prefill_load_scale=3.0,
        router_temperature=0.5,
        router_assume_kv_reuse=False,
        router_track_prefill_tokens=False,
        shared_cache_multiplier=0.5,
        host_cache_hit_weight=0.5,
    )


@pytest.mark.parametrize(
    ("override", "credit", "scale"),
    [
        (RouterConfigOverride(overlap_score_weight=2.5), 0.75, 2.5),
        (RouterConfigOverride(overlap_score_weight=0.0), 0.0, 0.0),
        (RouterConfigOverride(overlap_score_weight=2.5, overlap_score_credit=0.5, prefill_load_scale=3.0), 0.5, 2.5),
        (RouterConfigOverride(overlap_score_weight=0.0, overlap_score_credit=0.5, prefill_load_scale=3.0), 0.0, 0.0),
    ],
)
def test_override_folds_the_deprecated_weight(override: RouterConfigOverride, credit: float, scale: float) -> None:
    applied = override.apply(RouterConfig(overlap_score_credit=0.75))
    assert (applied.overlap_score_credit, applied.prefill_load_scale) == (credit, scale)


@given(
    credit=st.none() | st.floats(allow_nan=False),
    scale=st.none() | st.floats(allow_nan=False),
    weight=st.none() | st.floats(allow_nan=False),
    temperature=st.none() | st.floats(allow_nan=False),
    shared=st.none() | st.floats(allow_nan=False),
)
def test_a_valid_override_yields_a_usable_config(
    credit: float | None, scale: float | None, weight: float | None, temperature: float | None, shared: float | None
) -> None:
    override = RouterConfigOverride(credit, scale, weight, temperature, None, None, shared)
    if override.validate() is None:
        config = override.apply(RouterConfig())
        assert math.isfinite(config.overlap_score_credit) and config.overlap_score_credit >= 0
        assert math.isfinite(config.prefill_load_scale) and config.prefill_load_scale >= 0
        assert math.isfinite(config.router_temperature) and config.router_temperature >= 0
        assert 0 <= config.shared_cache_multiplier <= 1


# resolve(): the environment and the command line's flags go through the same rules, flags winning.
FLAGS_OF = {"router_temperature": "--router-temperature", "prefill_load_scale": "--prefill-load-scale"}


def flag(field: str, raw: str) -> dict[str, tuple[str, str]]:
    return {field: (FLAGS_OF.get(field, "--" + field.replace("_", "-")), raw)}


@pytest.mark.parametrize(
    ("field", "raw", "message"),
    [
        # Before: --router-temperature nan made /select answer 500; negative values routed to the busiest worker.
        ("router_temperature", "nan", "--router-temperature='nan' must be a finite number"),
        ("router_temperature", "-1", "--router-temperature='-1' must be >= 0"),
        ("prefill_load_scale", "-0.5", "--prefill-load-scale='-0.5' must be >= 0"),
        ("prefill_load_scale", "1_0", "--prefill-load-scale='1_0' is not a number"),
        ("overlap_score_weight", "inf", "--overlap-score-weight='inf' must be a finite number"),
        ("host_cache_hit_weight", "2", "--host-cache-hit-weight='2' must be between 0 and 1"),
        ("use_kv_events", "maybe", "--use-kv-events='maybe' is not a boolean (use true/false, 1/0, yes/no or on/off)"),
    ],
)
def test_flags_are_refused_by_the_environments_rules(field: str, raw: str, message: str) -> None:
    with pytest.raises(InvalidSettings) as caught:
        resolve(env_settings({}), flag(field, raw))
    assert caught.value.problems == (message,)
    assert isinstance(caught.value, ValueError)


def test_a_later_layer_wins_field_by_field() -> None:
    env = env_settings({"DYN_ROUTER_TEMPERATURE": "0.5", "DYN_ROUTER_PREFILL_LOAD_SCALE": "2"})
    assert resolve(env, flag("router_temperature", "0.25")) == RouterConfig(
        router_temperature=0.25, prefill_load_scale=2.0
    )


def test_the_deprecated_weight_folds_within_its_layer() -> None:
    # An environment weight of 0 zeroes the credit; an explicit credit flag still wins over it.
    env = env_settings({"DYN_OVERLAP_SCORE_WEIGHT": "0"})
    assert resolve(env, flag("overlap_score_credit", "0.5")) == RouterConfig(
        overlap_score_credit=0.5, prefill_load_scale=0.0
    )
    # A weight flag wins over a scale flag, as the variable wins over the scale variable.
    assert resolve({**flag("overlap_score_weight", "3"), **flag("prefill_load_scale", "5")}) == RouterConfig(
        prefill_load_scale=3.0
    )


def test_problems_of_every_layer_are_reported_together() -> None:
    with pytest.raises(InvalidSettings) as caught:
        resolve(env_settings({"DYN_ROUTER_TTL_SECS": "-1"}), flag("router_temperature", "hot"))
    assert caught.value.problems == (
        "DYN_ROUTER_TTL_SECS='-1' must be >= 0",
        "--router-temperature='hot' is not a number",
    )
    assert str(caught.value).startswith("invalid router configuration: DYN_ROUTER_TTL_SECS")


@pytest.mark.parametrize(
    ("raw", "low", "high", "value", "problem"),
    [
        ("42", 0, 100, 42, None),
        ("+7", 0, 100, 7, None),
        ("-1", 0, 100, None, "--n='-1' must be between 0 and 100"),
        ("101", 0, 100, None, "--n='101' must be between 0 and 100"),
        ("1.0", 0, 100, None, "--n='1.0' is not a whole number"),
        (" 1", 0, 100, None, "--n=' 1' is not a whole number"),
        ("\u0661", 0, 100, None, "--n='\u0661' is not a whole number"),  # a non-ASCII digit int() would take
        ("9" * 5000, 0, 2**64 - 1, None, "must be between 0 and 18446744073709551615"),  # int() would raise
    ],
)
def test_parse_int(raw: str, low: int, high: int, value: int | None, problem: str | None) -> None:
    problems: list[str] = []
    assert parse_int("--n", raw, low, high, problems) == value
    if problem is None:
        assert problems == []
    else:
        (found,) = problems
        assert problem in found
