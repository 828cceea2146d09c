"""The prefix trie (``trie.py``, run here as pure Python: ``load_pure``) against an independent model kept in
dicts (``tests/core/trie_model.py``): driven with the same random operations, they must count, match and decay
alike on everything a caller sees: sizes, weighted sizes, overlap depths, path lengths, fraction entries, errors.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.actors.core import slots, trie
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.compiled import load_pure
from tests.core import trie_model as dict_trie

TABLE = load_pure("kvrouter.actors.core.trie", "kvrouter_oracle_table.trie")

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def observe(t: Any, live: list[list[int]], probes: list[list[int]]) -> tuple[Any, ...]:
    return (
        t.size,
        t.has_fractions,
        t.weighted_size(),
        [t.overlap_depth(p) for p in probes],
        [len(list(t.path(p))) for p in probes],
        t.fraction_entries([(str(i), p) for i, p in enumerate(live)]),
        t.check(),
    )


def step(t: Any, op: str, hashes: list[int], fraction: float, depth: int, live: list[list[int]]) -> Any:
    """One operation, removal and fractions only along live inserts (as the tries' callers guarantee)."""
    chosen = live[len(hashes) % len(live)] if live else None
    try:
        if op == "insert":
            return t.insert(hashes)
        if op == "remove" and chosen is not None:
            return t.remove(chosen)
        if op == "decay" and chosen is not None:
            return t.decay_exclusive_tail(chosen[:depth] + hashes, fraction)
        if op == "set_fraction" and chosen is not None and len(chosen) >= depth:
            return t.set_fraction(chosen, depth, fraction)
        return None
    except Exception as exc:  # both must fail alike
        return type(exc).__name__


few = st.lists(st.integers(0, 5), max_size=8)  # few values: paths share prefixes and diverge
wide = st.lists(st.integers(0, 2**64 - 1), max_size=8)  # u64 hashes: table tags spread


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert", "remove", "decay", "set_fraction"]),
            st.one_of(few, wide),
            st.floats(0.0, 1.0),
            st.integers(1, 8),
        ),
        max_size=80,
    )
)
def test_table_trie_and_dict_trie_agree(ops: list[tuple[str, list[int], float, int]]) -> None:
    table, dicts = TABLE.PrefixTrie(), dict_trie.PrefixTrie()
    live: list[list[int]] = []
    for op, hashes, fraction, depth in ops:
        if op == "insert" and live and depth % 2:  # half the inserts extend or branch off a live path
            hashes = live[depth % len(live)][:depth] + hashes
        assert step(table, op, hashes, fraction, depth, live) == step(dicts, op, hashes, fraction, depth, live)
        if op == "insert":
            live.append(hashes)
        elif op == "remove" and live:
            live.remove(live[len(hashes) % len(live)])
        probes = [p[:depth] + hashes for p in live[:3]] + [hashes]
        assert observe(table, live, probes) == observe(dicts, live, probes)


def test_long_chains_grow_and_shrink_the_table_and_reuse_node_ids() -> None:
    """Hundreds of 64-block u64 chains in and out, as a busy rank sees them: same counts as the dict trie at
    every step; a large table shrinks back when the rank empties (down to ``_KEEP_SLOTS``, never resized on
    the way), and freed node ids are handed out again."""
    rng = random.Random(7)
    prefixes = [[rng.getrandbits(64) for _ in range(64)] for _ in range(8)]
    table, dicts = TABLE.PrefixTrie(), dict_trie.PrefixTrie()
    live: list[list[int]] = []
    for i in range(600):
        shared = rng.randint(0, 64)
        hashes = prefixes[i % 8][:shared] + [rng.getrandbits(64) for _ in range(64 - shared)]
        table.insert(hashes)
        dicts.insert(hashes)
        assert table.overlap_depth(hashes) == dicts.overlap_depth(hashes) == 64
        if len(live) >= 150:
            gone = live.pop(rng.randrange(len(live)))
            table.remove(gone)
            dicts.remove(gone)
        live.append(hashes)
        assert table.size == dicts.size
    assert table.check() == [] and dicts.check() == []
    grown = len(table._slots)
    ids_used = table._used
    for hashes in live:
        table.remove(hashes)
        dicts.remove(hashes)
    assert table.size == dicts.size == 0
    assert table.check() == []
    assert grown > TABLE._KEEP_SLOTS
    assert len(table._slots) == TABLE._KEEP_SLOTS  # shrank with the rank, down to the size it keeps
    table.insert(live[0])
    assert table._used == ids_used  # a freed id was reused, none new
    assert table.size == 64 and table.check() == []


def colliding_key(parent_path: int, target: int) -> int:
    """The hash whose child under a node of path hash ``parent_path`` has path hash ``target`` (``_link`` inverted:
    its multiplier is odd, so it has an inverse modulo 2**64)."""
    return ((target * pow(TABLE._MIX, -1, 2**64)) % 2**64) ^ ((parent_path * TABLE._GOLDEN) % 2**64)


@pytest.mark.parametrize("module", [TABLE, trie], ids=["pure", "as imported"])
def test_paths_whose_path_hashes_collide_stay_two_positions(module: Any) -> None:
    """The path hash only says where to look: ``[7]`` and ``[8, x]`` built to share one (so one tag and one home
    slot) are two positions, each found, counted and removed on its own, as the dict trie counts them."""
    x = colliding_key(TABLE._link(0, 8), TABLE._link(0, 7))
    assert TABLE._link(TABLE._link(0, 8), x) == TABLE._link(0, 7)
    for t in (module.PrefixTrie(), dict_trie.PrefixTrie()):
        t.insert([7])
        t.insert([8, x])
        assert t.size == 3 and t.check() == []
        assert t.overlap_depth([7, x]) == 1 and t.overlap_depth([8, x]) == 2 and t.overlap_depth([x]) == 0
        t.remove([7])
        assert t.size == 2 and t.overlap_depth([7]) == 0 and t.overlap_depth([8, x]) == 2 and t.check() == []
        t.insert([8, x, 7])
        t.remove([8, x])
        assert t.size == 3 and t.overlap_depth([8, x, 7]) == 3 and t.check() == []


@pytest.mark.parametrize("module", [TABLE, dict_trie], ids=["table", "dict"])
def test_removing_a_path_never_inserted_is_a_key_error(module: Any) -> None:
    t = module.PrefixTrie()
    t.insert([1, 2, 3])
    with pytest.raises(KeyError):
        t.remove([1, 9])
    with pytest.raises(KeyError):
        t.remove([7])


def test_the_slot_tracker_uses_the_node_table_trie() -> None:
    assert slots.PrefixTrie is trie.PrefixTrie
    assert type(slots.RankState(WorkerRank(0, 0)).trie) is trie.PrefixTrie
