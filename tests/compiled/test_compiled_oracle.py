"""The compiled hot modules against their pure-Python source, the oracle (README "Compiled hot paths").

Each test drives the compiled module (the one every other test and the service import) and a fresh
instance of the same ``.py`` run as pure Python with the same random operations, and asserts identical
results: return values, exceptions, and the observable state (dumps, snapshots, sizes, invariants).
Without a compiled build (no compiler at install, ``KVROUTER_PURE_PYTHON``, an edited source in an
editable install) the comparison is meaningless and skipped, except under CI, where gcc is present and a
missing compiled module is a broken build.
"""

from __future__ import annotations

import os
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrouter.actors.core.hashing as compiled_hashing
import kvrouter.actors.core.kv_batch_reader as compiled_kv_batch_reader
import kvrouter.actors.core.kv_index as compiled_kv_index
import kvrouter.actors.core.node_table as compiled_node_table
import kvrouter.actors.core.selection as compiled_selection
import kvrouter.actors.core.trie as compiled_trie
import kvrouter.api.bodies.select_body_reader as compiled_select_body_reader
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.compiled import COMPILED_MODULES, is_compiled, load_pure, status
from tests.support.select_body_bytes import body_bytes

PURE = {name: load_pure(name, "kvrouter_oracle." + name.rsplit(".", 1)[1]) for name in COMPILED_MODULES}
COMPILED = {
    m.__name__: m
    for m in (
        compiled_node_table,
        compiled_trie,
        compiled_kv_index,
        compiled_hashing,
        compiled_selection,
        compiled_kv_batch_reader,
        compiled_select_body_reader,
    )
}


def test_every_compiled_module_is_covered_here() -> None:
    assert set(COMPILED) == set(COMPILED_MODULES)


def test_the_oracle_runs_from_source() -> None:
    for module in PURE.values():
        assert not is_compiled(module)
        assert module.__file__ is not None and module.__file__.endswith(".py")
    # The pure index and trie call the pure node table, not the compiled one their compiled twins cimport.
    node_table = PURE["kvrouter.actors.core.node_table"]
    for name in ("kvrouter.actors.core.kv_index", "kvrouter.actors.core.trie"):
        assert PURE[name]._table_add is node_table.table_add
    assert PURE["kvrouter.actors.core.kv_index"]._child_tag is node_table.child_tag


@pytest.mark.skipif(not os.environ.get("CI"), reason="a build without a compiler is allowed outside CI")
def test_ci_runs_the_compiled_modules() -> None:
    assert status() == dict.fromkeys(COMPILED_MODULES, "compiled")
    assert all(is_compiled(m) for m in COMPILED.values())


def pair(name: str) -> tuple[ModuleType, ModuleType]:
    """(compiled, pure) for one module; skips when the compiled one is not running."""
    compiled = COMPILED[name]
    if not is_compiled(compiled):
        pytest.skip(f"{name}: {status()[name]}")
    return compiled, PURE[name]


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """A call's result, or its exception's type name and message (both implementations must raise alike)."""
    try:
        return ("ok", call())
    except Exception as exc:
        return (type(exc).__name__, str(exc))


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------------------- hashing

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)
bad_tokens = st.lists(
    st.one_of(
        st.integers(0, 2**32 - 1), st.integers(-(2**40), -1), st.integers(2**32, 2**70), st.floats(), st.booleans()
    ),
    max_size=20,
)
u64s = st.integers(0, 2**64 - 1)


@SETTINGS
@given(
    token_ids=st.one_of(tokens, bad_tokens),
    block_size=st.integers(-1, 9),
    lora=st.one_of(st.none(), st.text(max_size=6)),
    mm=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.integers(-(2**64), 2**65), max_size=3)))),
    eagle=st.booleans(),
    as_tuple=st.booleans(),
)
def test_block_hashes(
    token_ids: list[Any], block_size: int, lora: str | None, mm: list[Any] | None, eagle: bool, as_tuple: bool
) -> None:
    compiled, pure = pair("kvrouter.actors.core.hashing")
    tokens_in: Sequence[Any] = tuple(token_ids) if as_tuple else token_ids
    if as_tuple and all(type(t) is int and 0 <= t < 2**32 for t in token_ids):
        tokens_in = array("I", token_ids)  # what KV events carry: hashed in place, not converted

    def run(m: ModuleType) -> tuple[str, Any]:
        return outcome(
            lambda: m.block_hashes(tokens_in, block_size, lora_name=lora, mm_hashes_per_block=mm, eagle=eagle)
        )

    assert run(compiled) == run(pure)


@SETTINGS
@given(
    token_ids=st.one_of(tokens, bad_tokens),
    block_size=st.integers(-1, 9),
    lora=st.one_of(st.none(), st.text(max_size=6)),
    as_tuple=st.booleans(),
)
def test_prompt_hashes(token_ids: list[Any], block_size: int, lora: str | None, as_tuple: bool) -> None:
    """A prompt's block and sequence hashes in one call: what the two calls give, compiled and pure alike (for a
    tuple, a list, or the array("I") a /select body's reader makes)."""
    compiled, pure = pair("kvrouter.actors.core.hashing")
    tokens_in: Sequence[Any] = tuple(token_ids) if as_tuple else token_ids
    if not as_tuple and all(type(t) is int and 0 <= t < 2**32 for t in token_ids) and len(token_ids) % 2:
        tokens_in = array("I", token_ids)

    def run(m: ModuleType) -> tuple[str, Any]:
        return outcome(lambda: m.prompt_hashes(tokens_in, block_size, lora_name=lora))

    def separately(m: ModuleType) -> tuple[tuple[int, ...], tuple[int, ...]]:
        local = m.block_hashes(tokens_in, block_size, lora_name=lora)
        return tuple(local), tuple(m.sequence_hashes(local))

    assert run(compiled) == run(pure)
    if run(pure)[0] == "ok":
        assert run(compiled)[1] == separately(pure) == separately(compiled)


@SETTINGS
@given(
    token_ids=tokens,
    external=st.lists(u64s, max_size=12),
    block_size=st.integers(1, 9),
    lora=st.one_of(st.none(), st.text(max_size=6)),
    as_array=st.booleans(),
)
def test_stored_pairs(
    token_ids: list[int], external: list[int], block_size: int, lora: str | None, as_array: bool
) -> None:
    """A KV store's (external, local) pairs, made as each block is hashed when compiled: what the pure module's
    block hashes zipped with the external hashes give, for the token array a decoded batch carries or a tuple."""
    compiled, pure = pair("kvrouter.actors.core.hashing")
    count = min(len(external), len(token_ids) // block_size)
    tokens_in: Sequence[int] = array("I", token_ids) if as_array else tuple(token_ids)
    got = compiled.stored_pairs(tuple(external), tokens_in, block_size, count, lora_name=lora)
    assert got == pure.stored_pairs(tuple(external), tokens_in, block_size, count, lora_name=lora)
    local = pure.block_hashes(token_ids[: count * block_size], block_size, lora_name=lora)
    assert got == tuple(zip(external[:count], local, strict=True))
    assert type(got) is tuple and all(type(p) is tuple for p in got)


def test_the_compiled_hashing_calls_xxh3_in_c() -> None:
    """``hashing.pxd`` bound XXH3's C function (found in the xxhash package, checked against it at import): a
    block is one C call, not a Python call per block. Big-endian hosts keep the Python path."""
    compiled, pure = pair("kvrouter.actors.core.hashing")
    assert not pure.NATIVE_XXH3
    assert compiled.NATIVE_XXH3 is (sys.byteorder == "little")
    tokens_in = array("I", range(4096))
    assert compiled.block_hashes(tokens_in, 16) == pure.block_hashes(list(tokens_in), 16)
    assert compiled.block_hashes(tokens_in, 16, eagle=True) == pure.block_hashes(list(tokens_in), 16, eagle=True)
    assert compiled.block_hashes(tokens_in, 100, lora_name="x") == pure.block_hashes(tokens_in, 100, lora_name="x")


@SETTINGS
@given(
    token_ids=st.one_of(
        tokens,
        bad_tokens,
        st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([True, False, None, "1", 1.0, 2**32, -1]))),
    )
)
def test_token_id_checks(token_ids: list[Any]) -> None:
    compiled, pure = pair("kvrouter.actors.core.hashing")
    assert outcome(lambda: compiled.u32_token_ids(token_ids)) == outcome(lambda: pure.u32_token_ids(token_ids))
    valid = all(type(t) is int and 0 <= t < 2**32 for t in token_ids)
    assert pure.u32_token_ids(token_ids) is valid


@SETTINGS
@given(hashes=st.lists(st.integers(-(2**64), 2**65), max_size=70), prev=st.integers(-(2**64), 2**65), lora=st.text())
def test_sequence_hashes_and_seeds(hashes: list[int], prev: int, lora: str) -> None:
    compiled, pure = pair("kvrouter.actors.core.hashing")
    for m_call in (
        lambda m: m.sequence_hashes(hashes),
        lambda m: m.sequence_hashes(tuple(hashes)),
        lambda m: [m.next_sequence_hash(prev, h) for h in hashes[:5]],
        lambda m: m.lora_seed(lora),
    ):
        assert outcome(lambda m_call=m_call: m_call(compiled)) == outcome(lambda m_call=m_call: m_call(pure))


# -------------------------------------------------------------------------------- kv batch reader


@SETTINGS
@given(
    events=st.lists(
        st.one_of(
            st.tuples(
                st.just("BlockStored"),
                st.lists(st.integers(-(2**63), 2**64 - 1), max_size=6),
                st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
                st.lists(st.integers(0, 2**32 - 1), max_size=40),
                st.integers(0, 2**40),
                st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
                st.one_of(st.none(), st.sampled_from(["GPU", "cpu_pinned", "DISK", "other"])),
                st.one_of(st.none(), st.text(max_size=5)),
            ).map(lambda e: list(e)[: 5 + len(e[7] or "") % 4]),
            st.tuples(st.just("BlockRemoved"), st.lists(st.integers(0, 2**64 - 1), max_size=6)).map(list),
            st.just(["AllBlocksCleared"]),
        ),
        max_size=4,
    ),
    ts=st.one_of(st.floats(allow_nan=False), st.integers(-(2**63), 2**64 - 1)),
    dp_rank=st.one_of(st.none(), st.integers(0, 2**33)),
    damage=st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 255)),
)
def test_kv_batch_reader(events: list[Any], ts: Any, dp_rank: Any, damage: tuple[int, int, int]) -> None:
    compiled, pure = pair("kvrouter.actors.core.kv_batch_reader")
    payload = bytearray(msgpack.packb([ts, events, dp_rank]))
    how, where, value = damage
    if how == 1:  # cut short
        payload = payload[: where % len(payload)]
    elif how == 2:  # one byte changed
        payload[where % len(payload)] = value
    data = bytes(payload)
    # Compared as text: a changed byte can make the timestamp NaN, which equals nothing, itself included.
    assert repr(outcome(lambda: compiled.read_batch(data))) == repr(outcome(lambda: pure.read_batch(data)))


MAP_EVENT_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "parent_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "cache_salt",
    "locality",
    "block_mm_infos",
    "group_idx",
    "extra",
]


@SETTINGS
@given(
    events=st.lists(
        st.dictionaries(
            st.sampled_from(MAP_EVENT_KEYS),
            st.one_of(
                st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "LOCAL"]),
                st.none(),
                st.integers(-(2**63), 2**64 - 1),
                st.lists(st.integers(0, 2**64 - 1), max_size=6),
                st.lists(st.integers(0, 2**32 - 1), max_size=20),
                st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2),
                st.text(max_size=4),
            ),
            max_size=9,
        ),
        max_size=3,
    ),
    damage=st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 255)),
)
def test_kv_batch_reader_map_events(events: list[dict[str, Any]], damage: tuple[int, int, int]) -> None:
    """Map events (vLLM 0.33, SGLang 0.5): any keys in any order, values of any kind, damaged or not."""
    compiled, pure = pair("kvrouter.actors.core.kv_batch_reader")
    payload = bytearray(msgpack.packb([1.5, events, None]))
    how, where, value = damage
    if how == 1:
        payload = payload[: where % len(payload)]
    elif how == 2:
        payload[where % len(payload)] = value
    data = bytes(payload)
    assert repr(outcome(lambda: compiled.read_batch(data))) == repr(outcome(lambda: pure.read_batch(data)))


# -------------------------------------------------------------------------------- select body reader


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=body_bytes())
def test_select_body_reader(data: bytes) -> None:
    compiled, pure = pair("kvrouter.api.bodies.select_body_reader")
    assert outcome(lambda: compiled.read_select_body(data)) == outcome(lambda: pure.read_select_body(data))


# -------------------------------------------------------------------------------------------- trie

small_hashes = st.lists(st.integers(0, 5), max_size=8)  # few values: paths share prefixes and diverge


def trie_step(trie: Any, op: str, hashes: list[int], fraction: float, depth: int, live: list[list[int]]) -> Any:
    """One operation on a trie; removal and fractions only along live inserts, as the trie's callers guarantee.
    Queries follow a live path for ``depth`` blocks, then go on with ``hashes``, so they match deep."""
    chosen = live[len(hashes) % len(live)] if live else None
    if op in ("depth", "decay", "path") and chosen is not None:
        hashes = chosen[:depth] + hashes
    if op == "insert":
        result = outcome(lambda: trie.insert(hashes))
    elif op == "remove":
        result = outcome(lambda: trie.remove(chosen)) if chosen is not None else None
    elif op == "depth":
        result = outcome(lambda: trie.overlap_depth(hashes))
    elif op == "decay":
        result = outcome(lambda: trie.decay_exclusive_tail(hashes, fraction))
    elif op == "set_fraction":
        ok = chosen is not None and len(chosen) >= depth
        result = outcome(lambda: trie.set_fraction(chosen, depth, fraction)) if ok else None
    else:
        result = outcome(lambda: list(trie.path(hashes)))
    entries = trie.fraction_entries([(str(i), p) for i, p in enumerate(live)])
    return result, trie.size, trie.has_fractions, trie.weighted_size(), trie.check(), entries


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "remove", "depth", "decay", "set_fraction", "path"]),
            small_hashes,
            st.floats(0.0, 1.0),
            st.integers(1, 8),
        ),
        max_size=60,
    )
)
def test_prefix_trie(ops: list[tuple[str, list[int], float, int]]) -> None:
    compiled, pure = pair("kvrouter.actors.core.trie")
    compiled_trie, pure_trie = compiled.PrefixTrie(), pure.PrefixTrie()
    live: list[list[int]] = []
    for op, hashes, fraction, depth in ops:
        if op == "insert" and live and depth % 2:  # half the inserts extend or branch off a live path
            hashes = live[depth % len(live)][:depth] + hashes
        assert trie_step(compiled_trie, op, hashes, fraction, depth, live) == trie_step(
            pure_trie, op, hashes, fraction, depth, live
        )
        if op == "insert":
            live.append(hashes)
        elif op == "remove" and live:
            live.pop(len(hashes) % len(live))


@settings(SETTINGS, max_examples=40)
@given(seed=st.integers(0, 2**32), signed=st.booleans())
def test_prefix_trie_tables(seed: int, signed: bool) -> None:
    """Long chains of 64-bit hashes (some out of u64 range: both builds key them modulo 2**64): the node table
    grows, shifts entries back on removal, shrinks and reuses node ids, compiled exactly as in Python. Each seed is
    120 inserts and their removals, checked after every step, so fewer seeds than the other tests here: a pure
    table that shifted back one entry too few diverged on every one of 30 seeds tried."""
    compiled, pure = pair("kvrouter.actors.core.trie")
    compiled_trie, pure_trie = compiled.PrefixTrie(), pure.PrefixTrie()
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(64) - (2**63 if signed else 0) for _ in range(24)] for _ in range(4)]
    live: list[list[int]] = []
    for i in range(120):
        hashes = prefixes[i % 4][: rng.randint(0, 24)] + [rng.getrandbits(64) for _ in range(rng.randint(0, 24))]
        for t in (compiled_trie, pure_trie):
            t.insert(hashes)
        live.append(hashes)
        if len(live) > 12 or rng.random() < 0.2:
            gone = live.pop(rng.randrange(len(live)))
            for t in (compiled_trie, pure_trie):
                t.remove(gone)
        probe = live[-1] if live else hashes
        assert trie_step(compiled_trie, "path", probe, 0.5, 8, live) == trie_step(
            pure_trie, "path", probe, 0.5, 8, live
        )
    assert compiled_trie.check() == pure_trie.check() == []


# ---------------------------------------------------------------------------------------- KV index

ranks = st.sampled_from([WorkerRank(0, 0), WorkerRank(0, 1), WorkerRank(1, 0)])  # few: ops meet on one rank
ext_hashes = st.integers(0, 9)  # tiny spaces: stores collide, rename, move and reconnect
local_hashes = st.integers(0, 4)
tiers = st.sampled_from([0, 0, 0, 1, 2, 3])  # mostly device, where the tree lives
parents = st.one_of(st.none(), st.none(), ext_hashes)  # mostly from the root: a random parent is often unknown
index_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("stored"),
            ranks,
            tiers,
            parents,
            st.lists(st.tuples(ext_hashes, local_hashes), min_size=1, max_size=5),
        ),
        st.tuples(
            st.just("stored"),
            ranks,
            tiers,
            parents,
            st.lists(st.tuples(ext_hashes, local_hashes), min_size=1, max_size=5),
        ),
        st.tuples(st.just("removed"), ranks, tiers, st.lists(ext_hashes, min_size=1, max_size=4)),
        st.tuples(st.just("removed"), ranks, tiers, st.lists(ext_hashes, min_size=1, max_size=4)),
        st.tuples(st.just("cleared"), ranks),
        st.tuples(st.just("remove_rank"), ranks),
        st.tuples(st.just("remove_worker"), st.integers(0, 1)),
        st.tuples(st.just("match"), st.lists(local_hashes, max_size=7)),
    ),
    min_size=5,
    max_size=60,
)


def index_view(index: Any) -> tuple[Any, ...]:
    """Everything observable about an index, as plain data (the two modules' classes differ)."""
    runs = [(r.rank, int(r.tier), r.parent_hash, r.blocks) for r in index.dump_events()]
    counts = {rank: {int(t): n for t, n in per.items()} for rank, per in index.rank_block_counts().items()}
    return (
        runs,
        index.to_snapshot(),
        counts,
        index.block_count(),
        index.node_count(),
        index.ranks(),
        index.is_empty(),
        index.check(),
    )


def apply_index_op(module: ModuleType, index: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    kind = op[0]
    if kind == "stored":
        return outcome(lambda: index.apply_stored(op[1], module.Tier(op[2]), op[3], op[4]))
    if kind == "removed":
        return outcome(lambda: index.apply_removed(op[1], module.Tier(op[2]), op[3]))
    if kind == "cleared":
        return outcome(lambda: index.apply_cleared(op[1]))
    if kind == "remove_rank":
        return outcome(lambda: index.remove_rank(op[1]))
    if kind == "remove_worker":
        return outcome(lambda: index.remove_worker(op[1]))
    return outcome(lambda: {rank: tuple(o) for rank, o in index.find_matches(op[1]).items()})


@SETTINGS
@given(ops=index_ops, queries=st.lists(st.lists(local_hashes, max_size=7), max_size=4))
def test_kv_index(ops: list[tuple[Any, ...]], queries: list[list[int]]) -> None:
    compiled, pure = pair("kvrouter.actors.core.kv_index")
    indexes = compiled.KvIndex(), pure.KvIndex()
    for op in ops:
        assert apply_index_op(compiled, indexes[0], op) == apply_index_op(pure, indexes[1], op)
        assert index_view(indexes[0]) == index_view(indexes[1])
    for query in queries:
        assert apply_index_op(compiled, indexes[0], ("match", query)) == apply_index_op(
            pure, indexes[1], ("match", query)
        )
    # A snapshot taken by either rebuilds the same index in the other.
    snapshot = indexes[0].to_snapshot()
    assert index_view(pure.KvIndex.from_snapshot(snapshot)) == index_view(compiled.KvIndex.from_snapshot(snapshot))


def test_the_index_is_compiled_with_its_types() -> None:
    """``kv_index.pxd`` reached the build: the node tables are C functions and ``KvIndex`` an extension type
    (a build that misses the .pxd compiles the module untyped, several times slower; it happened once)."""
    compiled, pure = pair("kvrouter.actors.core.kv_index")
    assert hasattr(pure, "_child_tag") and hasattr(pure.KvIndex(), "__slots__")
    assert not hasattr(compiled, "_child_tag") and not hasattr(compiled, "_table_remove")
    with pytest.raises(AttributeError):
        compiled.KvIndex()._slots  # noqa: B018 - a C field, invisible from Python


def test_the_trie_is_compiled_with_its_types() -> None:
    """``trie.pxd`` reached the build: the node table is C functions and ``PrefixTrie`` an extension type."""
    compiled, pure = pair("kvrouter.actors.core.trie")
    assert hasattr(pure, "_link") and hasattr(pure.PrefixTrie(), "_slots")
    assert not hasattr(compiled, "_link") and not hasattr(compiled, "_table_remove")
    with pytest.raises(AttributeError):
        compiled.PrefixTrie()._slots  # noqa: B018 - a C field, invisible from Python


wide_hashes = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 40))  # mostly distinct, some collide
chain_ops = st.lists(
    st.one_of(
        st.tuples(st.just("chain"), ranks, st.integers(0, 2**16), st.integers(1, 40), st.booleans()),
        st.tuples(st.just("removed"), ranks, st.integers(0, 2**16), st.integers(0, 39)),
        st.tuples(st.just("cleared"), ranks),
        st.tuples(st.just("trim"), ranks, st.integers(0, 12)),
        st.tuples(st.just("remove_rank"), ranks),
    ),
    min_size=1,
    max_size=40,
)


def chain_blocks(seed: int, length: int, shared_root: bool) -> list[tuple[int, int]]:
    """A chain of 64-bit (external, local) hashes; ``shared_root`` chains start alike, so ranks share nodes."""
    rng = random.Random(seed)
    blocks = [(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(length)]
    if shared_root:
        blocks[: min(4, length)] = [(1000 + i, 2000 + i) for i in range(min(4, length))]
    return blocks


def apply_chain_op(index: Any, module: ModuleType, op: tuple[Any, ...]) -> tuple[str, Any]:
    kind, rank = op[0], op[1]
    if kind == "chain":
        blocks = chain_blocks(op[2], op[3], op[4])
        half = len(blocks) // 2
        first = outcome(lambda: index.apply_stored(rank, module.Tier.DEVICE, None, blocks[:half]))
        parent = blocks[half - 1][0] if half else None
        return first, outcome(lambda: index.apply_stored(rank, module.Tier.DEVICE, parent, blocks[half:]))
    if kind == "removed":
        blocks = chain_blocks(op[2], 40, False)
        return outcome(lambda: index.apply_removed(rank, module.Tier.DEVICE, [blocks[op[3]][0]]))
    if kind == "cleared":
        return outcome(lambda: index.apply_cleared(rank))
    if kind == "trim":
        return outcome(lambda: (index.trim_plan(rank, op[2]), index.trim(rank, op[2])))
    return outcome(lambda: index.remove_rank(rank))


@SETTINGS
@given(ops=chain_ops, query_seeds=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 40)), max_size=6))
def test_kv_index_tables_grow_and_shrink_alike(ops: list[tuple[Any, ...]], query_seeds: list[tuple[int, int]]) -> None:
    """Long chains of 64-bit hashes (the small-space test above keeps the tables tiny): the node tables grow,
    shift entries back on removal and shrink, compiled exactly as in Python."""
    compiled, pure = pair("kvrouter.actors.core.kv_index")
    indexes = compiled.KvIndex(), pure.KvIndex()
    for op in ops:
        assert apply_chain_op(indexes[0], compiled, op) == apply_chain_op(indexes[1], pure, op)
        assert index_view(indexes[0]) == index_view(indexes[1])
        assert indexes[1].check() == []
    for seed, depth in query_seeds:
        query = [*[local for _, local in chain_blocks(seed, 40, seed % 2 == 0)][:depth], seed, seed + 1]
        assert apply_index_op(compiled, indexes[0], ("match", query)) == apply_index_op(
            pure, indexes[1], ("match", query)
        )


long_stores = st.lists(
    st.tuples(
        ranks,
        st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.integers(0, 300)),
        st.lists(
            st.tuples(
                st.one_of(st.integers(0, 300), st.integers(-(2**63), -1), st.integers(2**63, 2**64 - 1)),
                st.integers(-(2**63), 2**64 - 1),
            ),
            max_size=140,
        ),
    ),
    min_size=1,
    max_size=8,
)


@SETTINGS
@given(stores=long_stores)
def test_kv_index_long_stores_with_signed_and_repeated_hashes(stores: list[tuple[Any, ...]]) -> None:
    """Stores longer than the pairwise duplicate check (64 hashes; a set beyond), hashes handed over signed or
    unsigned (taken as u64 in C, masked in Python), repeats (the store is refused), parents found or not."""
    compiled, pure = pair("kvrouter.actors.core.kv_index")
    indexes = compiled.KvIndex(), pure.KvIndex()
    for rank, parent, blocks in stores:
        exts = [ext for ext, _ in blocks]
        assert compiled.distinct_hashes(parent, exts) == pure.distinct_hashes(parent, exts)
        assert apply_index_op(compiled, indexes[0], ("stored", rank, 0, parent, blocks)) == apply_index_op(
            pure, indexes[1], ("stored", rank, 0, parent, blocks)
        )
        assert index_view(indexes[0]) == index_view(indexes[1])
        assert indexes[1].check() == []


# -------------------------------------------------------------------------------------- node table

table_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 2**16), st.integers(0, 2**64 - 1)), max_size=300)


def run_table(module: ModuleType, ops: list[tuple[bool, int, int]]) -> list[Any]:
    """Add and remove nodes (keyed by child tags) growing and shrinking as the index does; every step's table."""
    slots, shift = module.new_slots(8), module.shift_for(8)
    live: dict[int, int] = {}
    seen = []
    for add, parent, key in ops:
        if add or not live:
            node = len(seen)
            if (len(live) + 1) * 4 > len(slots) * 3:
                slots, shift = module.resized(slots, len(slots) * 2)
            live[node] = module.child_tag(parent, key)
            module.table_add(slots, shift, live[node], node)
        else:
            node = sorted(live)[key % len(live)]
            module.table_remove(slots, shift, live.pop(node), node)
            if len(live) * 8 < len(slots) and len(slots) > 8:
                slots, shift = module.resized(slots, len(slots) // 2)
        seen.append((list(slots), shift, module.entries(slots)))
    return seen


@SETTINGS
@given(ops=table_ops)
def test_node_tables(ops: list[tuple[bool, int, int]]) -> None:
    compiled, pure = pair("kvrouter.actors.core.node_table")
    assert run_table(compiled, ops) == run_table(pure, ops)


# --------------------------------------------------------------------------------------- selection

weights = st.floats(0.0, 4.0)
configs = st.builds(
    RouterConfig,
    overlap_score_credit=weights,
    overlap_score_credit_decay=weights,
    router_temperature=st.floats(0.0, 2.0),
    router_track_prefill_tokens=st.booleans(),
    host_cache_hit_weight=weights,
    disk_cache_hit_weight=weights,
    shared_cache_multiplier=weights,
    prefill_load_scale=weights,
    decode_active_request_weight=weights,
)
candidate_fields = st.tuples(
    st.tuples(*(st.integers(0, 70) for _ in range(5))),  # overlap per tier
    st.integers(0, 5000),  # active prefill tokens
    st.integers(0, 300),  # active decode blocks
    st.integers(0, 20),  # active requests
    st.integers(0, 70),  # prompt overlap depth
    st.frozensets(st.sampled_from(["a", "b", "c"]), max_size=2),
)


class _Trie:
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def overlap_depth(self, hashes: Sequence[int]) -> int:
        return min(self.depth, len(hashes))


class _Loads:
    def __init__(self, prefill: int, decode: int, requests: int, depth: int) -> None:
        # As the slots invariants have it: no live request, no decode blocks.
        self.prefill_tokens, self.active_decode_blocks = prefill, decode if requests else 0
        self.requests = {f"r{i}": None for i in range(requests)}
        self.trie = _Trie(depth)


class _Record:
    def __init__(self, worker_id: int, ranks: int, taints: frozenset[str]) -> None:
        self.ranks = tuple(WorkerRank(worker_id, r) for r in range(ranks))
        self.taint_set = taints


@SETTINGS
@given(
    workers=st.lists(
        st.tuples(st.integers(1, 3), st.frozensets(st.sampled_from(["a", "b"]), max_size=2)), min_size=1, max_size=5
    ),
    # One entry per rank: at most 5 workers of 3 ranks (entries past the 15th were drawn and never read).
    loads=st.lists(
        st.tuples(st.integers(0, 900), st.integers(0, 50), st.integers(0, 3), st.integers(0, 9)),
        min_size=15,
        max_size=15,
    ),
    # The KV index's overlaps have four tiers (``kv_index.Overlap``), a TierOverlap five.
    matched=st.lists(st.lists(st.integers(0, 9), min_size=4, max_size=5).map(tuple), min_size=15, max_size=15),
    hashes=st.lists(u64s, max_size=12),
)
def test_rank_candidates(workers: list[Any], loads: list[Any], matched: list[Any], hashes: list[int]) -> None:
    compiled, pure = pair("kvrouter.actors.core.selection")
    records = [_Record(worker_id, ranks, taints) for worker_id, (ranks, taints) in enumerate(workers)]
    ranks = [rank for record in records for rank in record.ranks]
    by_rank = {rank: _Loads(*loads[i]) for i, rank in enumerate(ranks)}
    matches = {rank: matched[i] for i, rank in enumerate(ranks) if i % 2}

    def build(m: ModuleType) -> list[tuple[Any, ...]]:
        built = m.rank_candidates(records, by_rank, matches, tuple(hashes))
        assert all(type(c) is m.RankCandidate and type(c.overlap) is m.TierOverlap for c in built)
        return [tuple(c) for c in built]

    assert build(compiled) == build(pure)


@SETTINGS
@given(
    config=configs,
    # Idle ranks with nothing cached (None: NO_OVERLAP) are scored once between them (``cheapest``).
    fields=st.lists(
        st.one_of(candidate_fields, st.tuples(st.none(), *(st.just(0),) * 4, candidate_fields.map(lambda f: f[5]))),
        min_size=1,
        max_size=6,
    ),
    isl=st.integers(0, 5000),
    num_seq_hashes=st.integers(0, 300),
    block_size=st.integers(1, 64),
    preferred=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0.0, 3.0), max_size=2),
    decode_pool=st.booleans(),
    draw=st.floats(0.0, 1.0, exclude_max=True),
)
def test_scoring(
    config: RouterConfig,
    fields: list[Any],
    isl: int,
    num_seq_hashes: int,
    block_size: int,
    preferred: dict[str, float],
    decode_pool: bool,
    draw: float,
) -> None:
    compiled, pure = pair("kvrouter.actors.core.selection")

    def score(m: ModuleType) -> tuple[Any, ...]:
        candidates = [
            m.RankCandidate(
                WorkerRank(i, 0),
                m.NO_OVERLAP if overlap is None else m.TierOverlap(*overlap),
                prefill,
                decode,
                requests,
                depth,
                taints,
            )
            for i, (overlap, prefill, decode, requests, depth, taints) in enumerate(fields)
        ]
        least = min(c.active_prefill_tokens for c in candidates)
        costs = [
            (
                c.rank,
                m.cost(
                    c,
                    isl=isl,
                    num_seq_hashes=num_seq_hashes,
                    block_size=block_size,
                    config=config,
                    min_active_prefill=least,
                    preferred_taints=preferred,
                    decode_pool=decode_pool,
                ),
            )
            for c in candidates
        ]
        cached = [m.effective_cached_tokens(c.overlap, config, block_size) for c in candidates]
        summary = m.overlap_summary({i: c.overlap for i, c in enumerate(candidates)}, block_size)
        chosen = outcome(lambda: m.pick(costs, temperature=config.router_temperature, draw=draw))
        cheapest = m.cheapest(
            candidates,
            isl=isl,
            num_seq_hashes=num_seq_hashes,
            block_size=block_size,
            config=config,
            preferred_taints=preferred,
            draw=draw,
        )
        if chosen[0] == "ok" and not decode_pool:  # the pick over each rank's own cost (cheapest aggregates)
            assert cheapest.rank == chosen[1]
        return costs, cached, summary, chosen, tuple(cheapest)

    compiled_result, pure_result = score(compiled), score(pure)
    # Bit-identical floats, NaN included (compare the representations, NaN != NaN).
    assert repr(compiled_result) == repr(pure_result)
