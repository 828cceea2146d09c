"""``actors.core.draws``: the desk's copy of a selection with its draw, reservation id, round-robin turn and
predicted and out ranks is ``attrs.evolve`` spelled out, so it must copy every other field of ``SelectWorker``,
including one added later; the generated reservation ids are the version-4 UUIDs ``uuid`` makes of the same bits."""

from __future__ import annotations

import uuid

import attrs
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.commands import Prompt, SelectionOptions, SelectWorker
from kvrouter.actors.core.draws import drawn, uuid4_text
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_modes import StreamView
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.ttft_model import RankTiming, TtftView

# Every field, none at its default: a field SelectWorker gains must be added here (and to ``drawn``).
NOT_DEFAULT = {
    "prompt": Prompt((1, 2, 3), lora_name="l"),
    "config": RouterConfig(router_temperature=0.5),
    "options": SelectionOptions(expected_output_tokens=7, session_id="s"),
    "reserve": True,
    "reservation_id": "r",
    "selection_id": "s",
    "draw": 0.25,
    "at": 99,
    "predicted_ranks": frozenset({WorkerRank(1, 0)}),
    "writer_id": 3,
    "turn": 4,
    "explain": True,
    "ttft": TtftView((RankTiming(WorkerRank(1, 0), samples=2),)),
    "streams": StreamView(((WorkerRank(2, 0), 5),)),
    "out_ranks": frozenset({WorkerRank(4, 0)}),
}


def test_every_field_of_a_selection_is_listed_here() -> None:
    assert [field.name for field in attrs.fields(SelectWorker)] == list(NOT_DEFAULT)
    assert all(
        getattr(SelectWorker(NOT_DEFAULT["prompt"], NOT_DEFAULT["config"]), name) != value
        for name, value in NOT_DEFAULT.items()
        if name not in ("prompt", "config")
    )


def test_drawn_is_evolve_of_the_draw_reservation_id_turn_predicted_and_out_ranks() -> None:
    command = SelectWorker(**NOT_DEFAULT)  # type: ignore[arg-type]
    predicted, out = frozenset({WorkerRank(3, 1)}), frozenset({WorkerRank(5, 0)})
    for reservation_id in ("other", None):
        expected = attrs.evolve(
            command, draw=0.75, reservation_id=reservation_id, turn=9, predicted_ranks=predicted, out_ranks=out
        )
        assert drawn(command, 0.75, reservation_id, 9, predicted, out) == expected


@given(st.integers(0, 2**128 - 1))
def test_a_generated_id_is_the_version_4_uuid_of_its_bits(bits: int) -> None:
    assert uuid4_text(bits) == str(uuid.UUID(int=bits, version=4))
