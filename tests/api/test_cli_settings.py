"""settings_from(): parsed flags and the environment become a checked launch, or every problem at once.

Rules marked "as 1.6.1" were checked by starting ``python -m dynamo.select_service`` with the same flags.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE
from kvrouter.actors.core.router_config import InvalidSettings, RouterConfig
from kvrouter.api.cli.main import build_parser
from kvrouter.api.cli.settings import SELECTION_CACHE_MAX_BYTES, Launch, settings_from
from kvrouter.api.process.journal_backend import JetStreamJournalOptions


def launch(*flags: str, env: dict[str, str] | None = None, service: str = "select-service") -> Launch:
    return settings_from(build_parser().parse_args([service, "--data-dir", "d", *flags]), env or {})


def problems(*flags: str, env: dict[str, str] | None = None) -> tuple[str, ...]:
    with pytest.raises(InvalidSettings) as raised:
        launch(*flags, env=env)
    return raised.value.problems


def test_defaults() -> None:
    started = launch()
    assert started.router == RouterConfig()
    assert started.options.port == 8092 and started.options.seed is None
    assert (started.options.selection_cache_ttl_secs, started.options.selection_cache_max_entries) == (120.0, 4096)
    assert started.options.selection_cache_max_bytes == SELECTION_CACHE_MAX_BYTES == 268_435_456  # 1.6.1's default
    assert started.warnings == ()


def test_flags_win_over_the_environment() -> None:
    env = {"DYN_ROUTER_TEMPERATURE": "0.5", "DYN_ROUTER_PREFILL_LOAD_SCALE": "3"}
    router = launch("--router-temperature", "0.25", env=env).router
    assert router == RouterConfig(router_temperature=0.25, prefill_load_scale=3.0)


def test_a_bad_variable_is_refused_even_when_a_flag_sets_the_same_knob() -> None:
    assert problems("--router-temperature", "1", env={"DYN_ROUTER_TEMPERATURE": "nan"}) == (
        "DYN_ROUTER_TEMPERATURE='nan' must be a finite number",
    )


def test_the_selection_cache_flags_reach_the_service_options() -> None:
    started = launch("--selection-cache-ttl-secs", "0", "--selection-cache-max-entries", "0")
    assert (started.options.selection_cache_ttl_secs, started.options.selection_cache_max_entries) == (0.0, 0)


def test_selection_cache_max_bytes_is_checked_and_carried() -> None:
    started = launch("--selection-cache-max-bytes", "1048576")
    assert started.options.selection_cache_max_bytes == 1_048_576
    assert started.warnings == ()  # enforced now (actors/core/pending.py), so nothing to warn about


def test_assume_kv_reuse_flag_sets_the_config_and_the_ignored_form_is_warned() -> None:
    assert launch("--router-assume-kv-reuse").warnings == ()
    started = launch("--no-router-assume-kv-reuse")
    assert started.router is not None and started.router.router_assume_kv_reuse is False
    (warning,) = started.warnings
    assert warning.startswith("--no-router-assume-kv-reuse is ignored: kvrouter always books")
    (warning,) = launch(env={"DYN_ROUTER_ASSUME_KV_REUSE": "off"}).warnings
    assert warning.startswith("DYN_ROUTER_ASSUME_KV_REUSE=off is ignored")
    assert launch("--router-assume-kv-reuse", env={"DYN_ROUTER_ASSUME_KV_REUSE": "off"}).warnings == ()


def test_the_public_tracking_hash_is_kvrouters_own_and_not_warned() -> None:
    assert launch("--router-tracking-hash", "public-xxh3-v1").warnings == ()


def test_a_valid_keyed_tracking_hash_is_accepted_with_a_warning_per_flag(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    flags = ["--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-file", str(key)]
    warnings = launch(*flags, "--router-tracking-key-id", "e1").warnings
    assert [w.split(" ", 1)[0] for w in warnings] == [
        "--router-tracking-hash",
        "--router-tracking-key-file",
        "--router-tracking-key-id",
    ]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # as 1.6.1: "router tracking key options require router_tracking_hash=keyed-xxh3-v1"
        (["--router-tracking-key-id", "e1"], "require --router-tracking-hash keyed-xxh3-v1"),
        (["--router-tracking-key-file", "KEY32"], "require --router-tracking-hash keyed-xxh3-v1"),
        # as 1.6.1: "keyed-xxh3-v1 requires router_tracking_key_file"
        (
            ["--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-id", "e1"],
            "requires --router-tracking-key-file",
        ),
        # as 1.6.1: "keyed-xxh3-v1 requires a nonempty router_tracking_key_id"
        (["--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-file", "KEY32"], "non-empty"),
        (
            [
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                "KEY32",
                "--router-tracking-key-id",
                "",
            ],
            "non-empty",
        ),
        # as 1.6.1: "router tracking key file must contain exactly 32 raw bytes; found 31" (and 64 for a hex key)
        (
            [
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                "KEY31",
                "--router-tracking-key-id",
                "e",
            ],
            "must hold exactly 32 raw bytes; found 31",
        ),
        (
            [
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                "HEX",
                "--router-tracking-key-id",
                "e",
            ],
            "must hold exactly 32 raw bytes; found more than 32",
        ),
        # as 1.6.1: "failed to read router tracking key file"
        (
            [
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                "MISSING",
                "--router-tracking-key-id",
                "e",
            ],
            "cannot be read (No such file or directory)",
        ),
    ],
)
def test_tracking_key_rules(flags: list[str], expected: str, tmp_path: Path) -> None:
    files = {"KEY32": b"k" * 32, "KEY31": b"k" * 31, "HEX": b"ab" * 32}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    flags = [str(tmp_path / f) if f in (*files, "MISSING") else f for f in flags]
    (problem,) = problems(*flags)
    assert expected in problem


def test_session_affinity_is_checked_as_1_6_1_checks_it_then_used() -> None:
    # as 1.6.1: "session_affinity_ttl_secs must be between 1 and 31536000" for 0.5 and 31536001; 1.5 starts.
    assert problems("--session-affinity-ttl-secs", "0.5") == (
        "--session-affinity-ttl-secs='0.5' must be between 1 and 31536000",
    )
    assert problems("--session-affinity-ttl-secs", "31536001")
    started = launch("--session-affinity-ttl-secs", "1.5")
    assert started.warnings == ()
    assert started.router is not None and started.router.session_affinity_ttl_secs == 1.5
    assert launch().router.session_affinity_ttl_secs is None  # type: ignore[union-attr]


def test_overload_and_approximate_mode_flags_go_through_the_router_rules() -> None:
    started = launch(
        "--router-queue-threshold", "1.5", "--router-queue-policy", "lcfs", "--active-decode-blocks-threshold", "0.9",
        "--active-prefill-tokens-threshold", "4096", "--active-prefill-tokens-threshold-frac", "2",
        "--router-max-tree-size", "1000", "--router-prune-target-ratio", "0.5", "--router-ttl-secs", "30",
        "--kv-events-stale-secs", "0",
    )  # fmt: skip
    router = started.router
    assert router is not None
    assert (router.router_queue_threshold, router.router_queue_policy) == (1.5, "lcfs")
    assert (router.active_decode_blocks_threshold, router.active_prefill_tokens_threshold) == (0.9, 4096.0)
    assert router.active_prefill_tokens_threshold_frac == 2.0
    assert (router.router_max_tree_size, router.router_prune_target_ratio, router.router_ttl_secs) == (1000, 0.5, 30.0)
    assert router.kv_events_stale_secs == 0.0
    assert problems("--active-decode-blocks-threshold", "1.2", "--router-max-tree-size", "0") == (
        "--router-max-tree-size='0' must be between 1 and 281474976710656",
        "--active-decode-blocks-threshold='1.2' must be between 0 and 1",
    )


def test_threads_is_warned_only_when_given() -> None:
    assert launch("--threads", "0").warnings == (
        "--threads 0 has no effect: kvrouter's index runs on the service's one thread",
    )


def test_the_slot_tracker_ignores_router_variables() -> None:
    started = launch(service="slot-tracker", env={"DYN_ROUTER_TEMPERATURE": "nan"})
    assert started.router is None and started.options.port == 8091


def test_max_index_blocks_per_scope_is_checked_and_carried() -> None:
    assert launch().options.max_index_blocks_per_scope == MAX_INDEX_BLOCKS_PER_SCOPE == 8 * 1024 * 1024
    assert launch("--max-index-blocks-per-scope", "1000").options.max_index_blocks_per_scope == 1000
    (problem,) = problems("--max-index-blocks-per-scope", "0")
    assert problem.startswith("--max-index-blocks-per-scope")


def test_http_write_timeout_is_checked_and_carried() -> None:
    assert launch().options.http.write_timeout == 30.0
    assert launch("--http-write-timeout-secs", "2.5").options.http.write_timeout == 2.5
    (problem,) = problems("--http-write-timeout-secs", "0")
    assert problem.startswith("--http-write-timeout-secs")


def test_the_jetstream_journal_takes_its_stream_and_the_nats_servers() -> None:
    options = launch("--journal", "jetstream", "--jetstream-stream", "ROUTER_A", "--nats-server", "n1:4222,n2:4222")
    assert options.options.jetstream_journal == JetStreamJournalOptions(
        ("nats://n1:4222", "nats://n2:4222"), "ROUTER_A"
    )
    assert options.warnings == ()  # --nats-server serves the journal here, not the event plane
    slots = launch("--journal", "jetstream", env={"NATS_SERVER": "nats://n3:4222"}, service="slot-tracker")
    assert slots.options.jetstream_journal == JetStreamJournalOptions(("nats://n3:4222",), "KVROUTER_SLOT_TRACKER")
    assert launch().options.jetstream_journal is None  # the file journal stays the default


def test_the_stream_replicas_reach_the_journal_and_the_cluster_and_a_bad_count_is_refused() -> None:
    options = launch("--journal", "jetstream", "--nats-server", "n1:4222", "--jetstream-replicas", "3")
    assert options.options.jetstream_journal is not None
    assert options.options.jetstream_journal.replicas == 3
    assert launch("--journal", "jetstream", "--nats-server", "n1:4222").options.jetstream_journal.replicas == 1
    cluster = launch(
        "--cluster", "c1", "--etcd-endpoints", "e:2379", "--nats-server", "n1:4222", "--advertise-url",
        "http://127.0.0.1:8091", "--jetstream-replicas", "3", service="slot-tracker",
    )  # fmt: skip
    assert cluster.options.cluster is not None and cluster.options.cluster.jetstream_replicas == 3
    assert problems("--journal", "jetstream", "--jetstream-replicas", "0") == (
        "--jetstream-replicas='0' must be between 1 and 5",
    )
    assert launch("--jetstream-replicas", "3").warnings == (
        "--jetstream-replicas has no effect without --journal jetstream or --cluster",
    )


def test_a_bad_stream_name_is_refused_and_a_stray_stream_flag_warned() -> None:
    assert problems("--journal", "jetstream", "--jetstream-stream", "a.b") == (
        "--jetstream-stream='a.b' must be 1-64 letters, digits, '_' or '-'",
    )
    assert launch("--jetstream-stream", "X").warnings == (
        "--jetstream-stream has no effect without --journal jetstream",
    )


CLUSTER_FLAGS = ("--cluster", "c1", "--etcd-endpoints", "e:2379", "--nats-server", "n1:4222")


def cluster_problems(*flags: str, service: str) -> tuple[str, ...]:
    with pytest.raises(InvalidSettings) as raised:
        launch(*CLUSTER_FLAGS, *flags, service=service)
    return raised.value.problems


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:8001/some/path", "has a path (/some/path)"),
        ("http://127.0.0.1:8001?x=1", "has a query"),
        ("http://127.0.0.1:8001#top", "has a fragment"),
        ("http://user:pass@127.0.0.1:8001", "has user information"),
        ("http://:8001", "has no host"),
        ("http://127.0.0.1", "has no port"),
        ("http://127.0.0.1:http", "has an invalid port"),
        ("127.0.0.1:8001", "is not an http:// URL"),
        ("https://127.0.0.1:8001", "is not an http:// URL"),
        ("http://0.0.0.0:8001", "names no host the others can reach"),
    ],
)
def test_an_advertise_url_that_is_not_http_host_port_is_refused(service: str, url: str, says: str) -> None:
    (problem,) = cluster_problems("--advertise-url", url, service=service)
    assert problem.startswith("--advertise-url: ") and says in problem, problem
    assert problem.endswith("expected http://HOST:PORT, where the others reach this replica"), problem


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
def test_an_advertise_url_of_host_and_port_is_taken_without_its_trailing_slash(service: str) -> None:
    for url in ("http://127.0.0.1:8001", "http://127.0.0.1:8001/", "http://replica-2.example:8001", "http://[::1]:80"):
        cluster = launch(*CLUSTER_FLAGS, "--advertise-url", url, service=service).options.cluster
        assert cluster is not None and cluster.advertise_url == url.rstrip("/")


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--journal", "file"), "--cluster does not take --journal file"),
        (("--jetstream-stream", "OTHER"), "--cluster does not take --jetstream-stream"),
        (("--durability", "off"), "--cluster does not take --durability off"),
        (("--durability", "batch"), "--cluster does not take --durability batch"),
        (("--fresh",), "--cluster does not take --fresh"),
        (("--replica-max-peers", "4"), "--cluster replaces replica sync; leave --replica-max-peers out"),
        (("--replica-peer-max-rate", "10"), "--cluster replaces replica sync; leave --replica-peer-max-rate out"),
    ],
)
def test_a_journal_flag_a_replica_would_ignore_is_refused(service: str, flags: tuple[str, ...], says: str) -> None:
    (problem,) = cluster_problems("--advertise-url", "http://127.0.0.1:8001", *flags, service=service)
    assert problem.startswith(says), problem


@pytest.mark.parametrize("service", ["slot-tracker", "select-service"])
def test_the_journal_flags_that_say_what_a_replica_does_are_taken_quietly(service: str) -> None:
    started = launch(
        *CLUSTER_FLAGS, "--advertise-url", "http://127.0.0.1:8001", "--journal", "jetstream", "--durability",
        "always", service=service,
    )  # fmt: skip
    assert started.options.cluster is not None and started.warnings == ()


def test_the_durability_and_journal_defaults_are_unchanged_outside_a_cluster() -> None:
    started = launch(service="slot-tracker")
    assert started.options.durability.value == "always" and started.options.jetstream_journal is None
    assert launch("--durability", "off", "--fresh", service="slot-tracker").options.durability.value == "off"
