"""The on-disk format is pinned by golden files: one record per event tag, and one snapshot.

A changed encoding (a renamed, added or dropped field, a new tag spelling) fails here until it is made
deliberately: bump the format version, add an upcaster for the old one, write the new golden files.
The old files stay and keep proving that what older builds wrote still decodes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
from golden_samples import (
    RECORDS,
    SAMPLES,
    SCOPE,
    SNAPSHOT_LSN,
    SNAPSHOTS,
    record_path,
    sample_states,
    sample_states_written_by,
    sample_written_by,
    snapshot_path,
)

import kvrouter.actors.persistence.codec as codec
import kvrouter.actors.persistence.snapshots as snapshots
from kvrouter.actors.core.events import EVENT_TAGS, RequestAdded, RequestFreed
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.persistence.codec import (
    RECORD_VERSION,
    RecordFormatError,
    decode_record,
    digest,
    encode_record,
    event_upcaster,
)
from kvrouter.actors.persistence.snapshots import (
    SNAPSHOT_VERSION,
    UnreadableSnapshot,
    encode_snapshot,
    restore_snapshot,
    snapshot_upcaster,
)

GOLDEN_RECORD = re.compile(r"(?P<tag>[a-z_]+)\.v(?P<version>\d+)\.json")
TAGS = sorted(EVENT_TAGS.values())


def golden_records() -> list[tuple[str, int, Path]]:
    found = []
    for path in sorted(RECORDS.iterdir()):
        match = GOLDEN_RECORD.fullmatch(path.name)
        assert match, f"{path.name} is not named <event tag>.v<version>.json"
        found.append((match["tag"], int(match["version"]), path))
    return found


# -- records ----------------------------------------------------------------------------------------


def test_every_event_tag_has_a_sample_and_a_golden_record_of_the_current_version() -> None:
    assert sorted(SAMPLES) == TAGS, "add a sample to golden_samples.SAMPLES for each new event tag"
    assert {tag: EVENT_TAGS[type(event)] for tag, event in SAMPLES.items()} == {tag: tag for tag in SAMPLES}
    missing = [tag for tag in TAGS if not record_path(tag, RECORD_VERSION).exists()]
    assert missing == [], "run tests/persistence/make_goldens.py and commit the new files"


def test_golden_records_name_only_known_tags_and_versions() -> None:
    found = golden_records()
    assert {(tag in TAGS, version <= RECORD_VERSION) for tag, version, _ in found} == {(True, True)}
    assert {version for _, version, _ in found} == set(range(RECORD_VERSION + 1)), "a version lost its goldens"


@pytest.mark.parametrize("tag", TAGS)
def test_encoding_the_sample_gives_exactly_the_golden_bytes(tag: str) -> None:
    golden = record_path(tag, RECORD_VERSION).read_bytes()
    assert encode_record(SCOPE, (SAMPLES[tag],)) == golden


@pytest.mark.parametrize("tag", TAGS)
def test_the_golden_names_every_field_of_the_event_class(tag: str) -> None:
    """Says plainly what the byte comparison above also catches: a field was renamed, added or dropped."""
    (fields,) = orjson.loads(record_path(tag, RECORD_VERSION).read_bytes())["events"]
    names = {field.name for field in attrs.fields(type(SAMPLES[tag]))}
    assert set(fields) - {"type"} == names, "a changed event field needs a RECORD_VERSION bump and an upcaster"


@pytest.mark.parametrize(("tag", "version", "path"), golden_records(), ids=[p.name for _, _, p in golden_records()])
def test_every_golden_record_of_every_version_decodes_to_its_sample(tag: str, version: int, path: Path) -> None:
    record = decode_record(path.read_bytes())
    assert record.scope == SCOPE
    assert record.events == (sample_written_by(tag, version),)


def test_version_zero_records_have_no_version_field_and_still_decode() -> None:
    payload = record_path("request_added", 0).read_bytes()
    assert "v" not in orjson.loads(payload)
    assert decode_record(payload).events == (sample_written_by("request_added", 0),)


def test_upcasters_run_in_version_order_on_old_records_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that reads v3, with request_freed's field renamed at v1 and a value changed at v2."""
    monkeypatch.setattr(codec, "RECORD_VERSION", 3)
    monkeypatch.setattr(codec, "EVENT_UPCASTERS", {})
    calls: list[int] = []

    @event_upcaster("request_freed", from_version=0)
    def _rename(fields: dict[str, Any]) -> dict[str, Any]:
        calls.append(0)
        fields["request_id"] = fields.pop("rid")
        return fields

    @event_upcaster("request_freed", from_version=2)
    def _prefix(fields: dict[str, Any]) -> dict[str, Any]:
        calls.append(2)
        fields["request_id"] = "old-" + fields["request_id"]
        return fields

    v0 = orjson.dumps({"scope": ["m", "t"], "events": [{"type": "request_freed", "rid": "r1"}]})
    assert decode_record(v0).events == (RequestFreed("old-r1"),)
    assert calls == [0, 2]
    v2 = orjson.dumps({"v": 2, "scope": ["m", "t"], "events": [{"type": "request_freed", "request_id": "r2"}]})
    assert decode_record(v2).events == (RequestFreed("old-r2"),)
    v3 = orjson.dumps({"v": 3, "scope": ["m", "t"], "events": [{"type": "request_freed", "request_id": "r3"}]})
    assert decode_record(v3).events == (RequestFreed("r3"),)  # current records skip the upcasters
    assert calls == [0, 2, 2]
    with pytest.raises(ValueError, match="two upcasters"):
        event_upcaster("request_freed", from_version=0)(_rename)
    with pytest.raises(ValueError, match="must read a version below 3"):
        event_upcaster("request_freed", from_version=3)(_rename)


def test_an_upcaster_that_raises_gives_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "EVENT_UPCASTERS", {("request_added", 0): lambda fields: fields["no such field"]})
    with pytest.raises(RecordFormatError, match=r"event 0 \(request_added\) fails its upcast from version 0: KeyError"):
        decode_record(record_path("request_added", 0).read_bytes())
    monkeypatch.setattr(snapshots, "SNAPSHOT_VERSION", 2)
    monkeypatch.setattr(snapshots, "SNAPSHOT_UPCASTERS", {1: lambda document: document["no such key"]})
    with pytest.raises(UnreadableSnapshot, match=r"an upcaster failed \(KeyError"):
        restore_snapshot(snapshot_path(1).read_bytes())


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b'{"v":1,"scope":["m","t"],"events":[{"type":"no_such_event"}]}', "unknown event tag 'no_such_event'"),
        (b'{"v":1,"scope":["m","t"],"events":[{"type":"request_freed"}]}', "missing field or unknown tag 'request_id'"),
        (b'{"v":1,"scope":["m","t"],"events":[{"request_id":"r"}]}', 'event 0 has no "type" tag'),
        (b'{"v":99,"scope":["m","t"],"events":[]}', "version 99 is newer than this build reads"),
        (b'{"v":"1","scope":["m","t"],"events":[]}', "invalid record format version '1'"),
        (b'{"scope":"m","events":[]}', "not a journal record"),
        (b"\x00\x01binary", "not a journal record"),
    ],
    ids=["unknown-tag", "missing-field", "untagged", "newer-version", "bad-version", "bad-scope", "not-json"],
)
def test_a_record_that_does_not_decode_says_why(payload: bytes, problem: str) -> None:
    with pytest.raises(RecordFormatError, match=re.escape(problem)):
        decode_record(payload)


# -- snapshots --------------------------------------------------------------------------------------


def sample_snapshot() -> bytes:
    return encode_snapshot(SNAPSHOT_LSN, [state.to_snapshot() for state in sample_states()])


def snapshot_digest(states: list[Any]) -> str:
    return digest([state.to_snapshot() for state in sorted(states, key=lambda s: s.scope)])


def test_encoding_the_sample_states_gives_exactly_the_golden_snapshot() -> None:
    assert sample_snapshot() == snapshot_path(SNAPSHOT_VERSION).read_bytes()


def golden_snapshots() -> list[tuple[int, Path]]:
    found = []
    for path in sorted(SNAPSHOTS.iterdir()):
        match = re.fullmatch(r"snapshot\.v(\d+)\.json", path.name)
        assert match, f"{path.name} is not named snapshot.v<version>.json"
        found.append((int(match[1]), path))
    return found


def test_every_snapshot_version_has_its_golden() -> None:
    assert [version for version, _ in golden_snapshots()] == list(range(1, SNAPSHOT_VERSION + 1))


@pytest.mark.parametrize(("version", "path"), golden_snapshots(), ids=[p.name for _, p in golden_snapshots()])
def test_every_golden_snapshot_restores_to_the_sample_states(version: int, path: Path) -> None:
    restored = restore_snapshot(path.read_bytes())
    expected = sample_states_written_by(version)
    assert sorted(restored) == [state.scope for state in expected]
    assert snapshot_digest(list(restored.values())) == snapshot_digest(expected)


def test_the_v1_snapshot_splits_its_block_size_between_the_parts() -> None:
    """v1 had one ``block_size`` per scope: the slot tracker's, or the selection partition's."""
    restored = restore_snapshot(snapshot_path(1).read_bytes())
    tracker, partition = (restored[scope] for scope in sorted(restored))
    assert (tracker.slots.block_size, tracker.selection.partition_block_size) == (16, None)
    assert (partition.slots.block_size, partition.selection.partition_block_size) == (None, 32)
    (outputs,) = [rank.outputs for rank in tracker.slots.ranks.values() if rank.outputs]
    assert outputs == {"req-a": (2, 0.25, 0)}  # v1's two blocks at the latest fraction, as they were


def test_a_snapshot_upcaster_is_one_registered_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build reading the next version: every golden goes through each step up from its version, the current
    one through the last."""
    current = SNAPSHOT_VERSION
    monkeypatch.setattr(snapshots, "SNAPSHOT_VERSION", current + 1)
    monkeypatch.setattr(snapshots, "SNAPSHOT_UPCASTERS", dict(snapshots.SNAPSHOT_UPCASTERS))

    @snapshot_upcaster(from_version=current)
    def _scopes_to_next(document: dict[str, Any]) -> dict[str, Any]:
        for scope in document["scopes"]:
            scope["tenant_id"] = scope["tenant_id"].upper()  # visible in the restored states
        return document

    for version in range(1, current + 1):
        restored = restore_snapshot(snapshot_path(version).read_bytes())
        assert sorted(scope.tenant_id for scope in restored) == ["GOLDEN-TENANT", "SELECTION-TENANT"]
    with pytest.raises(ValueError, match="two snapshot upcasters"):
        snapshot_upcaster(from_version=current)(_scopes_to_next)


def test_the_v2_snapshot_moves_booked_blocks_to_the_predicted_index() -> None:
    """v2 kept approximate-mode bookings in the one index; v3 keeps them apart from the KV-event index."""
    restored = restore_snapshot(snapshot_path(2).read_bytes())
    selection = restored[sorted(restored)[1]].selection
    booked, from_events = WorkerRank(9, 0), WorkerRank(9, 1)
    assert selection.predicted.rank_block_counts() == {booked: {Tier.DEVICE: 2}}
    assert selection.index.rank_block_counts() == {from_events: {Tier.DEVICE: 2}}
    assert selection.sessions == {}


def test_an_old_snapshot_is_checked_against_its_hash_before_upcasting() -> None:
    document = orjson.loads(snapshot_path(1).read_bytes())
    document["scopes"][0]["block_size"] = 64  # damage the hash does not cover
    with pytest.raises(UnreadableSnapshot, match="do not match its recorded state hash"):
        restore_snapshot(orjson.dumps(document))


def test_a_snapshot_without_an_upcaster_for_its_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "SNAPSHOT_UPCASTERS", {})
    with pytest.raises(UnreadableSnapshot, match="no upcaster reads snapshot format version 1"):
        restore_snapshot(snapshot_path(1).read_bytes())


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"v": 7}, "snapshot format version 7 is newer than this build reads"),
        ({"state_hash": "0" * 64}, "does not restore to its recorded state hash"),
        ({"scopes": [{"model_name": "m"}]}, "a scope does not restore (KeyError"),
    ],
    ids=["newer-version", "wrong-hash", "bad-scope"],
)
def test_a_snapshot_that_does_not_restore_says_why(change: dict[str, Any], problem: str) -> None:
    document = {**orjson.loads(snapshot_path(SNAPSHOT_VERSION).read_bytes()), **change}
    with pytest.raises(UnreadableSnapshot, match=re.escape(problem)) as raised:
        restore_snapshot(orjson.dumps(document))
    assert raised.value.lsn == SNAPSHOT_LSN
    assert "--fresh" in str(raised.value) and "backup" in str(raised.value)


def test_request_added_golden_is_readable_by_eye() -> None:
    """The format is JSON an operator can read in a hex dump: tag, fields, then the version up front."""
    text = record_path("request_added", RECORD_VERSION).read_text()
    assert text.startswith(f'{{"v":{RECORD_VERSION},"scope":["golden-model","golden-tenant"],"events":[')
    assert '"type":"request_added"' in text and RequestAdded.__name__ not in text
