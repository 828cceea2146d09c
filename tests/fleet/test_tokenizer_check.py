"""A discovered worker's model-card tokenizer checksum against --model-path's (``actors/fleet/tokenizer_check.py``):
parsed from the card Dynamo writes, compared with the BLAKE3 digest of the local ``tokenizer.json``, reported once
per worker (log line, ``GET /workers``'s ``tokenizer``, ``/metrics``), never corrected."""

from __future__ import annotations

import logging
from pathlib import Path

import blake3
import pytest

from kvrouter.actors.fleet.dynamo_layout import Layout
from kvrouter.actors.fleet.tokenizer_check import TokenizerCheck, local_checksum
from tests.support.dynamo_keys import INSTANCE, card_key, card_value, instance_key, instance_value

OTHER = INSTANCE + 1


def discovered(*cards: tuple[int, str]) -> dict:
    layout = Layout()
    for instance, checksum in cards:
        layout.put(instance_key(instance), instance_value(instance))
        layout.put(card_key(instance), card_value(instance, tokenizer_checksum=checksum))
    workers, skipped = layout.workers(kv_events_endpoint=None)
    assert skipped == {}
    return workers


def test_the_local_checksum_is_the_blake3_of_the_file_as_a_card_spells_it(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"abc")
    # BLAKE3's published test vector for "abc".
    assert local_checksum(path) == "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    big = bytes(range(256)) * 20_000  # over the 1 MiB read chunk
    path.write_bytes(big)
    assert local_checksum(path) == "blake3:" + blake3.blake3(big).hexdigest()


def test_a_cards_checksum_reaches_its_discovered_worker() -> None:
    workers = discovered((INSTANCE, "blake3:cd"))
    assert workers[INSTANCE].tokenizer_checksum == "blake3:cd"


def test_a_mismatch_is_reported_once_per_worker_and_shown(caplog: pytest.LogCaptureFixture) -> None:
    local = "blake3:" + "1" * 64
    check = TokenizerCheck(local)
    with caplog.at_level(logging.WARNING, logger="kvrouter.fleet"):
        check.follow(discovered((INSTANCE, local), (OTHER, "blake3:" + "2" * 64)))
        check.follow(discovered((INSTANCE, local), (OTHER, "blake3:" + "2" * 64)))  # the same again: no new line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"worker {OTHER} (model tiny): its model card's tokenizer is ")
    assert check.status(INSTANCE) == {"card_checksum": local, "local_checksum": local, "matches": True}
    assert check.status(OTHER)["matches"] is False
    figures = {family.name: family.series[0].value for family in check.families()}
    assert figures == {
        "kvrouter_tokenizer_checked_workers": 2.0,
        "kvrouter_tokenizer_mismatched_workers": 1.0,
        "kvrouter_tokenizer_mismatches_reported": 1.0,
    }
    # Its card changes to another wrong digest: reported again; then it leaves: forgotten.
    check.follow(discovered((INSTANCE, local), (OTHER, "blake3:" + "3" * 64)))
    assert check.mismatches_reported == 2
    check.follow(discovered((INSTANCE, local)))
    assert check.status(OTHER) == {}


def test_a_card_without_a_comparable_checksum_is_not_compared() -> None:
    check = TokenizerCheck("blake3:" + "1" * 64)
    check.follow(discovered((INSTANCE, "sha256:00")))
    assert check.status(INSTANCE) == {}
    assert check.mismatches_reported == 0
