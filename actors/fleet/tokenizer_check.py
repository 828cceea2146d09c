"""Is each discovered worker's tokenizer the one kvrouter tokenizes with? Checked, not guessed.

A Dynamo worker's model card names its ``tokenizer.json`` with a checksum, ``"blake3:<hex>"`` (the BLAKE3 digest of
the file's bytes, ``actors/fleet/dynamo_layout.py``). With ``--model-path``, kvrouter knows the digest of its own
``tokenizer.json`` (``local_checksum``), and every card discovery shows is compared with it: a worker whose card
names another digest tokenizes differently, so the router's block hashes cannot match what its engine caches. It
is reported (one log line per worker, when first seen so or when its digest changes; ``GET /workers``'s
``tokenizer``; ``/metrics``), never corrected: which side is right is the operator's call. A card without a
checksum, or with another algorithm, is not compared (``unchecked``). ``docs/tokenizing.md#workers-model-cards``.

Bounded by the discovered workers: entries of workers discovery no longer shows are dropped at each change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs
import blake3

from kvrouter.actors.fleet.dynamo_layout import DiscoveredWorker
from kvrouter.actors.metric_families import Family, counter, gauge

log = logging.getLogger("kvrouter.fleet")

BLAKE3: Final = "blake3:"


def local_checksum(tokenizer_json: Path) -> str:
    """``"blake3:<hex>"`` of the file, as a Dynamo model card spells its tokenizer's checksum."""
    hasher = blake3.blake3()
    with tokenizer_json.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            hasher.update(chunk)
    return BLAKE3 + hasher.hexdigest()


@attrs.frozen
class Verdict:
    """One discovered worker's card checksum against the local one."""

    card: str
    matches: bool


class TokenizerCheck:
    def __init__(self, local: str) -> None:
        self.local = local
        self._verdicts: dict[int, Verdict] = {}
        self.mismatches_reported = 0  # since the start: log lines written

    def follow(self, workers: Mapping[int, DiscoveredWorker]) -> None:
        """Discovery shows ``workers`` now: compare each card's checksum, report each new or changed mismatch."""
        verdicts: dict[int, Verdict] = {}
        for worker_id, worker in workers.items():
            card = worker.tokenizer_checksum
            if card is None or not card.startswith(BLAKE3):
                continue
            verdict = Verdict(card, card.lower() == self.local)
            verdicts[worker_id] = verdict
            if not verdict.matches and self._verdicts.get(worker_id) != verdict:
                self.mismatches_reported += 1
                log.warning(
                    "worker %d (model %s): its model card's tokenizer is %s, --model-path's is %s: the router's "
                    "block hashes will not match what it caches",
                    worker_id,
                    worker.record.model_name,
                    card,
                    self.local,
                )
        self._verdicts = verdicts

    def status(self, worker_id: int) -> dict[str, object]:
        """``GET /workers``'s ``tokenizer`` of one worker; empty when its card names no comparable checksum."""
        verdict = self._verdicts.get(worker_id)
        if verdict is None:
            return {}
        return {"card_checksum": verdict.card, "local_checksum": self.local, "matches": verdict.matches}

    def families(self) -> list[Family]:
        mismatched = sum(1 for verdict in self._verdicts.values() if not verdict.matches)
        return [
            gauge(
                "kvrouter_tokenizer_checked_workers",
                "Discovered workers whose model card's tokenizer checksum was compared with --model-path's",
                (),
                {(): float(len(self._verdicts))},
            ),
            gauge(
                "kvrouter_tokenizer_mismatched_workers",
                "Discovered workers whose model card names another tokenizer than --model-path's",
                (),
                {(): float(mismatched)},
            ),
            counter(
                "kvrouter_tokenizer_mismatches_reported",
                "Tokenizer mismatches reported (a worker first seen so, or its card's checksum changed)",
                (),
                {(): float(self.mismatches_reported)},
            ),
        ]
