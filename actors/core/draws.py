"""The random values a selection takes, drawn from a seeded source the shell hands over. Pure.

The core never makes randomness: the owner of a scope creates its source, seeded from the owner's seed and
the scope (so a simulation replays exactly), and the scope's desk (``actors/core/desk.py``) draws from it in a
fixed order per command: a generated reservation id first (128 bits, when one is needed), then each stage's
uniform number in [0, 1).
"""

from __future__ import annotations

from typing import Protocol

from kvrouter.actors.core.commands import SelectWorker
from kvrouter.actors.core.ids import WorkerRank

_VERSION_MASK = 0xF000 << 64
_VERSION_4 = 0x4000 << 64
_VARIANT_MASK = 0xC000 << 48
_VARIANT_RFC_4122 = 0x8000 << 48


class DrawSource(Protocol):
    """What the core asks of a random source (``random.Random`` is one)."""

    def random(self) -> float: ...

    def getrandbits(self, k: int, /) -> int: ...


def uuid4_text(bits: int) -> str:
    """The text of the version-4 UUID made of 128 random ``bits`` (``str(uuid.UUID(int=bits, version=4))``,
    which the core may not import)."""
    value = (bits & ~_VERSION_MASK & ~_VARIANT_MASK) | _VERSION_4 | _VARIANT_RFC_4122
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def generated_id(source: DrawSource) -> str:
    """A reservation id nobody gave: a version-4 UUID from the scope's source."""
    return uuid4_text(source.getrandbits(128))


def drawn(
    command: SelectWorker,
    draw: float,
    reservation_id: str | None,
    turn: int,
    predicted_ranks: frozenset[WorkerRank],
    out_ranks: frozenset[WorkerRank],
) -> SelectWorker:
    """``attrs.evolve(command, draw=..., reservation_id=..., turn=..., predicted_ranks=..., out_ranks=...)``,
    spelled out: every selection pays it, and evolve (which walks the fields) costs about three times as much.
    Every other field is copied (``tests/core/test_selection_draw.py`` fails when SelectWorker gains one this does
    not copy)."""
    return SelectWorker(
        prompt=command.prompt,
        config=command.config,
        options=command.options,
        reserve=command.reserve,
        reservation_id=reservation_id,
        selection_id=command.selection_id,
        draw=draw,
        at=command.at,
        predicted_ranks=predicted_ranks,
        writer_id=command.writer_id,
        turn=turn,
        explain=command.explain,
        streams=command.streams,
        ttft=command.ttft,
        out_ranks=out_ranks,
    )
