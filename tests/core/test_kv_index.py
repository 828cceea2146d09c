"""The KV block index: behaviour.md#the-kv-index tree semantics, behaviour.md#overlap-and-tiers tier extensions and the
reference's edge cases.

Cases marked "1.6.1 probe" were observed on the reference indexer (``dynamo.indexer`` 1.6.1, fed
by a ZMQ publisher) while writing this module.
"""

from __future__ import annotations

import json
from itertools import product

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.ids import U64_MASK, WorkerRank
from kvrouter.actors.core.kv_index import KvIndex, Overlap, StoredRun, Tier
from kvrouter.actors.core.kv_wire import BlockStored as WireStored
from kvrouter.actors.core.kv_wire import decode_batch, encode_batch, stored_blocks

R0 = WorkerRank(1, 0)
R1 = WorkerRank(1, 1)
R2 = WorkerRank(2, 0)
A, B, C, D, E = 101, 102, 103, 104, 105  # local hashes
DEV, HOST, DISK, EXT = Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL


def dev_store(index: KvIndex, rank: WorkerRank, parent: int | None, *locals_: int, base: int = 0) -> bool:
    """Store blocks whose external hash is ``base + local`` (distinct per test rank when ``base`` differs)."""
    return index.apply_stored(rank, DEV, parent, [(base + h, h) for h in locals_])


# ---------------------------------------------------------------------------------- device tree


def test_prefix_match_counts_leading_blocks() -> None:
    index = KvIndex()
    assert dev_store(index, R0, None, A, B, C)
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(3)}
    assert index.find_matches([A, B]) == {R0: Overlap(2)}
    assert index.find_matches([A, D, C]) == {R0: Overlap(1)}
    assert index.find_matches([B, C]) == {}  # missing block 0 scores nothing
    assert index.find_matches([]) == {}


def test_positions_are_paths_not_hashes() -> None:
    """The same local hash under another prefix is another position."""
    index = KvIndex()
    dev_store(index, R0, None, A, B)
    dev_store(index, R1, None, C, B)
    assert index.find_matches([A, B]) == {R0: Overlap(2)}
    assert index.find_matches([C, B]) == {R1: Overlap(2)}
    assert index.node_count() == 4


def test_ranks_sharing_a_prefix() -> None:
    index = KvIndex()
    dev_store(index, R0, None, A, B, C, D)
    dev_store(index, R1, None, A, B, base=1000)
    dev_store(index, R2, None, A, E, base=2000)
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(4), R1: Overlap(2), R2: Overlap(1)}
    assert index.node_count() == 5
    assert index.block_count() == 8


def test_store_under_a_known_parent_extends_the_chain() -> None:
    index = KvIndex()
    dev_store(index, R0, None, A, B)
    assert index.apply_stored(R0, DEV, B, [(C, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(3)}


def test_unknown_parent_stores_nothing() -> None:
    """Edge case 50."""
    index = KvIndex()
    dev_store(index, R0, None, A)
    dev_store(index, R1, None, A, B, base=1000)
    before = index.find_matches([A, B, C])
    assert not index.apply_stored(R0, DEV, 999, [(B, B), (C, C)])
    assert not index.apply_stored(R0, DEV, 1000 + A, [(B, B)])  # R1's block is not R0's parent
    assert not index.apply_stored(R2, DEV, A, [(B, B)])  # a rank that holds nothing
    assert index.find_matches([A, B, C]) == before
    assert index.block_count() == 3


def test_duplicate_hashes_in_a_store_are_a_no_op() -> None:
    """Edge case 51, also enforced by the index itself (a self-referencing store)."""
    index = KvIndex()
    dev_store(index, R0, None, A)
    assert not index.apply_stored(R0, DEV, A, [(A, B)])
    assert not index.apply_stored(R0, DEV, None, [(7, B), (7, C)])
    assert not index.apply_stored(R0, HOST, None, [(7, B), (7, C)])
    assert index.block_count() == 1


def test_block_size_mismatch_stores_nothing_end_to_end() -> None:
    """Edge case 52: the wire conversion yields no blocks, so the index is unchanged."""
    index = KvIndex()
    event = WireStored((1, 2), None, tuple(range(16)), 8)
    blocks = stored_blocks(event, 4)
    assert blocks == ()
    index.apply_stored(R0, DEV, event.parent_hash, blocks)
    assert index.block_count() == 0


def test_storing_held_blocks_is_idempotent() -> None:
    index = KvIndex()
    dev_store(index, R0, None, A, B)
    snapshot = index.to_snapshot()
    assert dev_store(index, R0, None, A, B)
    assert dev_store(index, R0, None, A)
    assert index.to_snapshot() == snapshot
    assert dev_store(index, R0, None, A, B, C)  # re-sending a prefix with an extension adds only the extension
    assert index.block_count() == 3
    assert index.find_matches([A, B, C]) == {R0: Overlap(3)}


def test_removing_a_middle_block_truncates_the_rank() -> None:
    """Edge case 53; and, as 1.6.1 does, the descendants stay gone when the block is stored again."""
    index = KvIndex()
    dev_store(index, R0, None, A, B, C, D)
    dev_store(index, R1, None, A, B, C, D, base=1000)
    assert index.apply_removed(R0, DEV, [B]) == 1
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(1), R1: Overlap(4)}
    assert index.block_count(R0) == 1
    assert not index.apply_stored(R0, DEV, C, [(E, E)])  # C went with B
    assert index.apply_stored(R0, DEV, A, [(B, B)])
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(2), R1: Overlap(4)}


def test_unknown_or_repeated_removals_are_skipped() -> None:
    index = KvIndex()
    dev_store(index, R0, None, A, B, C)
    assert index.apply_removed(R0, DEV, [999, C, C, B]) == 2
    assert index.apply_removed(R1, DEV, [A]) == 0
    assert index.apply_removed(R0, DEV, []) == 0
    assert index.find_matches([A, B, C]) == {R0: Overlap(1)}


def test_removing_a_root_frees_every_position() -> None:
    index = KvIndex()
    dev_store(index, R0, None, A, B, C)
    index.apply_stored(R0, DEV, B, [(D, D)])
    index.apply_removed(R0, DEV, [A])
    assert index.block_count() == 0
    assert index.node_count() == 0
    dev_store(index, R1, None, A, B)  # freed node ids are reused cleanly
    assert index.find_matches([A, B, C]) == {R1: Overlap(2)}


def test_cleared_affects_one_rank_in_every_tier() -> None:
    """Edge case 54 (1.6.1 probe: AllBlocksCleared also drops the rank's host-tier blocks)."""
    index = KvIndex()
    dev_store(index, R0, None, A, B)
    index.apply_stored(R0, HOST, B, [(C, C)])
    index.apply_stored(R0, HOST, None, [(50 + A, A)])
    dev_store(index, R1, None, A, B, base=1000)
    index.apply_stored(R1, DISK, 1000 + B, [(1000 + C, C)])
    index.apply_cleared(R0)
    assert index.find_matches([A, B, C]) == {R1: Overlap(2, 0, 1)}
    assert index.block_count(R0) == 0
    assert index.block_count(R1) == 3
    assert dev_store(index, R0, None, A)  # the rank can store again
    assert index.find_matches([A])[R0] == Overlap(1)


def test_remove_rank_and_remove_worker() -> None:
    index = KvIndex()
    for rank, base in ((R0, 0), (R1, 1000), (R2, 2000)):
        dev_store(index, rank, None, A, B, base=base)
        index.apply_stored(rank, HOST, base + B, [(base + C, C)])
    index.remove_rank(R1)
    assert set(index.find_matches([A, B, C])) == {R0, R2}
    assert index.ranks() == [R0, R2]
    index.remove_worker(1)
    assert index.find_matches([A, B, C]) == {R2: Overlap(2, 1)}
    assert index.ranks() == [R2]
    index.remove_worker(7)  # unknown: nothing happens
    dev_store(index, WorkerRank(9, 0), None, A, base=9000)  # a released bit is reused
    assert set(index.find_matches([A])) == {R2, WorkerRank(9, 0)}


def test_signed_external_hashes_are_reinterpreted() -> None:
    index = KvIndex()
    assert index.apply_stored(R0, DEV, None, [(-1, A)])
    assert index.apply_stored(R0, DEV, U64_MASK, [(-2, B)])
    assert index.find_matches([A, B]) == {R0: Overlap(2)}
    assert index.apply_removed(R0, DEV, [U64_MASK - 1]) == 1
    assert index.find_matches([A, B]) == {R0: Overlap(1)}


def test_same_hash_at_another_position_moves_the_block() -> None:
    """kvrouter keeps one position per (rank, external hash); 1.6.1 keeps a stale alias instead."""
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, DEV, None, [(2, C)])  # hash 2 now names [C]
    assert index.find_matches([A, B]) == {R0: Overlap(1)}
    assert index.find_matches([C]) == {R0: Overlap(1)}
    index.apply_removed(R0, DEV, [2])
    assert index.find_matches([C]) == {}
    # Moving an ancestor of the path being stored would cut that path: the store stops there.
    index.apply_stored(R0, DEV, 1, [(3, B)])
    assert index.apply_stored(R0, DEV, 3, [(4, C), (1, D), (5, E)])
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(3)}
    assert index.block_count(R0) == 3


def test_another_hash_at_a_held_position_renames_it() -> None:
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, DEV, 1, [(3, B), (4, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(3)}
    assert index.block_count(R0) == 3
    assert index.apply_removed(R0, DEV, [2]) == 0  # the old name is forgotten
    assert index.apply_removed(R0, DEV, [3]) == 1
    assert index.find_matches([A, B, C]) == {R0: Overlap(1)}


# --------------------------------------------------------------------------------- lower tiers


def test_spec_tier_example() -> None:
    """behaviour.md#overlap-and-tiers: rank0 (2 dev, 1 host, 2 disk), rank1 (1 dev, 1 disk) at block 16 (1.6.1 probe
    agrees)."""
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, HOST, 2, [(3, C)])
    index.apply_stored(R0, DISK, 3, [(4, D), (5, E)])
    index.apply_stored(R1, DEV, None, [(11, A)])
    index.apply_stored(R1, DISK, 11, [(12, B)])
    matches = index.find_matches([A, B, C, D, E])
    assert matches == {R0: Overlap(2, 1, 2, 0), R1: Overlap(1, 0, 1, 0)}
    bs = 16  # the Mooncake summary the selection service derives from these
    dp = {rank.dp_rank: o.device * bs for rank, o in matches.items()}
    cpu = max((o.device + o.host_ext) * bs for o in matches.values())
    disk = max(o.total * bs for o in matches.values())
    assert (dp, max(dp.values()), cpu, disk) == ({0: 32, 1: 16}, 32, 48, 80)


def test_host_tier_counts_only_beyond_the_device_match() -> None:
    """Edge case 58: a CPU_PINNED block counts for ``cpu`` but not ``gpu``, end to end from the wire."""
    index = KvIndex()
    tokens = tuple(range(12))
    locals_ = block_hashes(list(tokens), 4)
    payload = encode_batch(
        [
            WireStored((1, 2), None, tokens[:8], 4),
            WireStored((3,), 2, tokens[8:], 4, tier=HOST),
            ["BlockStored", [9], 3, list(tokens[:4]), 4, None, None, None, None, 0, None, None, "REMOTE"],
        ]
    )
    for event in decode_batch(payload).events:
        assert isinstance(event, WireStored)
        index.apply_stored(R0, event.tier, event.parent_hash, stored_blocks(event, 4))
    assert index.find_matches(locals_) == {R0: Overlap(2, 1)}
    assert index.block_count(R0, DEV) == 2
    assert index.block_count(R0, HOST) == 1
    assert index.block_count(R0, DISK) == 0


def test_lower_tiers_chain_device_host_disk_external() -> None:
    index = KvIndex()
    index.apply_stored(R0, HOST, None, [(1, A), (2, B)])  # no device blocks at all: host from the root
    index.apply_stored(R0, DISK, 2, [(3, C)])
    index.apply_stored(R0, EXT, 3, [(4, D)])
    assert index.find_matches([A, B, C, D, E]) == {R0: Overlap(0, 2, 1, 1)}
    assert index.find_matches([A, B, D]) == {R0: Overlap(0, 2, 0, 0)}  # D continues C, not B (1.6.1 probe)
    index.apply_stored(R0, DISK, 2, [(5, E)])
    assert index.find_matches([A, B, E]) == {R0: Overlap(0, 2, 1, 0)}


def test_disk_continues_the_device_match_when_host_has_nothing() -> None:
    """1.6.1 probe: dev A,B + disk C(parent B) ⇒ cpu 2 blocks, disk 3 blocks."""
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, DISK, 2, [(3, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(2, 0, 1)}


def test_lower_tier_continues_from_the_external_hash() -> None:
    """1.6.1 probe: a host chain naming A, B with other external hashes does not extend a device A, B."""
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, HOST, None, [(11, A), (12, B), (13, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(2)}
    index.apply_stored(R0, HOST, None, [(1, A), (2, B), (3, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(2, 1)}


def test_lower_tier_root_block_does_not_match_deeper() -> None:
    """1.6.1 probe: host C stored at the root does not continue device A, B."""
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, HOST, None, [(3, C)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(2)}
    assert index.find_matches([C]) == {R0: Overlap(0, 1)}


def test_lower_tier_accepts_unknown_parents() -> None:
    """1.6.1 probe: a host block whose parent is not (yet) known anywhere is kept."""
    index = KvIndex()
    assert index.apply_stored(R0, HOST, 999, [(3, C)])
    assert index.find_matches([A, B, C]) == {}
    index.apply_stored(R0, DEV, None, [(1, A), (999, B)])
    assert index.find_matches([A, B, C]) == {R0: Overlap(2, 1)}


def test_lower_tier_removal_drops_one_edge() -> None:
    """1.6.1 probe: removing host B and storing it again reconnects C and D."""
    index = KvIndex()
    index.apply_stored(R0, HOST, None, [(1, A), (2, B), (3, C), (4, D)])
    assert index.apply_removed(R0, HOST, [2, 77]) == 1
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(0, 1)}
    index.apply_stored(R0, HOST, 1, [(2, B)])
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(0, 4)}


def test_removal_only_touches_its_tier() -> None:
    index = KvIndex()
    index.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R0, HOST, None, [(1, A), (2, B), (3, C), (4, D)])
    assert index.apply_removed(R0, HOST, [2]) == 1
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(2, 2)}  # host C hangs off hash 2, still on device
    assert index.find_matches([A, B]) == {R0: Overlap(2)}
    index.apply_stored(R0, HOST, 1, [(2, B)])
    assert index.apply_removed(R0, DEV, [2]) == 1
    assert index.find_matches([A, B, C, D]) == {R0: Overlap(1, 3)}  # host B, C, D continue device A
    assert index.apply_removed(R0, DISK, [1]) == 0


def test_a_device_parent_must_be_on_device() -> None:
    """1.6.1 probe: a device store whose parent is only in the host tier is rejected."""
    index = KvIndex()
    index.apply_stored(R0, HOST, None, [(1, A)])
    assert not index.apply_stored(R0, DEV, 1, [(2, B)])
    assert index.find_matches([A, B]) == {R0: Overlap(0, 1)}


def test_rank_block_counts() -> None:
    index = KvIndex()
    index.apply_stored(R1, DEV, None, [(1, A), (2, B)])
    index.apply_stored(R1, EXT, 2, [(3, C)])
    index.apply_stored(R0, HOST, None, [(1, A)])
    assert index.rank_block_counts() == {R0: {HOST: 1}, R1: {DEV: 2, EXT: 1}}
    assert index.block_count(tier=HOST) == 1
    assert index.block_count(WorkerRank(5, 5)) == 0
    index.apply_removed(R0, HOST, [1])
    assert index.rank_block_counts() == {R1: {DEV: 2, EXT: 1}}


# ---------------------------------------------------------------------------- dump and snapshot


def populated() -> KvIndex:
    index = KvIndex()
    index.apply_stored(R1, DEV, None, [(1, A), (2, B), (3, C)])
    index.apply_stored(R1, DEV, 2, [(4, D), (5, E)])
    index.apply_stored(R1, DEV, 1, [(6, C)])
    index.apply_stored(R0, DEV, None, [(2**64 - 1, A)])
    index.apply_stored(R0, HOST, 2**64 - 1, [(7, B), (8, C)])
    index.apply_stored(R0, DISK, None, [(9, A)])
    return index


def test_dump_lists_parents_before_children_grouped_per_rank_and_tier() -> None:
    runs = populated().dump_events()
    assert runs == [
        StoredRun(R0, DEV, None, ((2**64 - 1, A),)),
        StoredRun(R0, HOST, 2**64 - 1, ((7, B),)),
        StoredRun(R0, HOST, 7, ((8, C),)),
        StoredRun(R0, DISK, None, ((9, A),)),
        StoredRun(R1, DEV, None, ((1, A),)),
        StoredRun(R1, DEV, 1, ((2, B),)),
        StoredRun(R1, DEV, 2, ((3, C),)),
        StoredRun(R1, DEV, 2, ((4, D), (5, E))),
        StoredRun(R1, DEV, 1, ((6, C),)),
    ]
    replayed = KvIndex()
    for run in runs:
        assert replayed.apply_stored(run.rank, run.tier, run.parent_hash, run.blocks)
    assert replayed.to_snapshot() == populated().to_snapshot()


def test_snapshot_round_trip() -> None:
    index = populated()
    snapshot = index.to_snapshot()
    assert json.loads(json.dumps(snapshot)) == snapshot  # plain JSON
    restored = KvIndex.from_snapshot(snapshot)
    assert restored.to_snapshot() == snapshot
    for query in product([A, B, C, D, E], repeat=3):
        assert restored.find_matches(list(query)) == index.find_matches(list(query))
    assert restored.block_count() == index.block_count() == 10


def test_snapshot_does_not_depend_on_history() -> None:
    first = KvIndex()
    first.apply_stored(R0, DEV, None, [(1, A), (2, B)])
    first.apply_stored(R0, DEV, 1, [(3, C)])
    second = KvIndex()
    second.apply_stored(R1, DEV, None, [(9, E)])  # occupy other node ids first
    second.apply_stored(R0, DEV, None, [(1, A)])
    second.apply_stored(R0, DEV, 1, [(3, C)])
    second.apply_stored(R0, DEV, 1, [(2, B)])
    second.remove_rank(R1)
    assert first.to_snapshot() == second.to_snapshot()


def test_empty_snapshot() -> None:
    assert KvIndex().to_snapshot() == {"v": 1, "ranks": []}
    assert KvIndex.from_snapshot({"v": 1, "ranks": []}).block_count() == 0


# ------------------------------------------------------------------------- model-based property


class NaiveIndex:
    """The semantics written down as directly as possible: device blocks are named positions (paths)."""

    def __init__(self) -> None:
        self.dev: dict[WorkerRank, dict[int, tuple[int, ...]]] = {}  # ext -> path of local hashes
        self.lower: dict[tuple[WorkerRank, Tier], dict[int, tuple[int | None, int]]] = {}  # ext -> (parent, local)

    def store(self, rank: WorkerRank, tier: Tier, parent: int | None, blocks: list[tuple[int, int]]) -> bool:
        exts = [e for e, _ in blocks]
        if len(set(exts)) != len(exts) or (blocks and parent in exts):
            return False
        if tier is not DEV:
            edges = self.lower.setdefault((rank, tier), {})
            for ext, local in blocks:
                for other in [e for e, edge in edges.items() if edge == (parent, local) and e != ext]:
                    del edges[other]
                edges[ext] = (parent, local)
                parent = ext
            return True
        held = self.dev.setdefault(rank, {})
        if parent is None:
            path: tuple[int, ...] = ()
        elif parent in held:
            path = held[parent]
        else:
            return False
        for ext, local in blocks:
            here = (*path, local)
            if held.get(ext) == here:
                path = here
                continue
            if ext in held:
                old = held[ext]
                if path[: len(old)] == old:
                    break
                self._cut(held, old)
            for other in [e for e, p in held.items() if p == here]:
                del held[other]
            held[ext] = here
            path = here
        return True

    @staticmethod
    def _cut(held: dict[int, tuple[int, ...]], top: tuple[int, ...]) -> None:
        for ext in [e for e, p in held.items() if p[: len(top)] == top]:
            del held[ext]

    def remove(self, rank: WorkerRank, tier: Tier, exts: list[int]) -> None:
        for ext in exts:
            if tier is DEV:
                held = self.dev.get(rank, {})
                if ext in held:
                    self._cut(held, held[ext])
            else:
                self.lower.get((rank, tier), {}).pop(ext, None)

    def clear(self, rank: WorkerRank) -> None:
        self.dev.pop(rank, None)
        for tier in (HOST, DISK, EXT):
            self.lower.pop((rank, tier), None)

    def remove_worker(self, worker_id: int) -> None:
        for rank in [r for r in self.dev if r.worker_id == worker_id]:
            self.clear(rank)
        for rank, _ in [k for k in self.lower if k[0].worker_id == worker_id]:
            self.clear(rank)

    def find_matches(self, query: list[int]) -> dict[WorkerRank, Overlap]:
        out = {}
        ranks = set(self.dev) | {r for r, _ in self.lower}
        for rank in ranks:
            held = self.dev.get(rank, {})
            by_path = {p: e for e, p in held.items()}
            device = 0
            while device < len(query) and tuple(query[: device + 1]) in by_path:
                device += 1
            last = by_path[tuple(query[:device])] if device else None
            pos, counts = device, []
            for tier in (HOST, DISK, EXT):
                edges = self.lower.get((rank, tier), {})
                start = pos
                while pos < len(query):
                    nxt = [e for e, edge in edges.items() if edge == (last, query[pos])]
                    if not nxt:
                        break
                    last = nxt[0]
                    pos += 1
                counts.append(pos - start)
            if pos:
                out[rank] = Overlap(device, *counts)
        return out

    def count(self, rank: WorkerRank, tier: Tier) -> int:
        if tier is DEV:
            return len(self.dev.get(rank, {}))
        return len(self.lower.get((rank, tier), {}))


RANKS = [R0, R1, R2]
EXTS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 2**64 - 1]
LOCALS = [0, 1, 2]  # a small alphabet, so ranks share positions and walks branch
QUERIES = [list(q) for n in range(1, 5) for q in product(LOCALS, repeat=n)] + [[0, 1, 2, 0, 1], [2, 1, 0, 2, 1]]


def draw_operation(data: st.DataObject, recent: dict[WorkerRank, list[int]]) -> tuple:  # type: ignore[type-arg]
    """Mostly stores; parents and removals usually name the rank's recently stored hashes, so chains grow deep
    and lower-tier edges hang off device blocks."""
    kind = data.draw(st.sampled_from(["store"] * 5 + ["remove", "remove", "clear", "remove_worker"]))
    rank = data.draw(st.sampled_from(RANKS))
    tier = data.draw(st.sampled_from([DEV, DEV, DEV, HOST, DISK, EXT]))
    hashes = st.sampled_from(EXTS)
    mine = recent.setdefault(rank, [])
    known = st.sampled_from(mine) | hashes if mine else hashes
    if kind == "store":
        parent = data.draw(st.none() | known)
        unique = data.draw(st.integers(0, 9)) > 0  # now and then a duplicate, which must be a no-op
        pairs = st.tuples(hashes, st.sampled_from(LOCALS))
        blocks = data.draw(st.lists(pairs, min_size=1, max_size=4, unique_by=(lambda p: p[0]) if unique else None))
        mine.extend(ext for ext, _ in blocks)
        del mine[:-6]
        return ("store", rank, tier, parent, blocks)
    if kind == "remove":
        return ("remove", rank, tier, data.draw(st.lists(known, max_size=2)))
    if kind == "clear":
        return ("clear", rank)
    return ("remove_worker", data.draw(st.sampled_from([1, 2])))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_find_matches_equals_a_naive_model(data: st.DataObject) -> None:
    index, model = KvIndex(), NaiveIndex()
    recent: dict[WorkerRank, list[int]] = {}
    for _ in range(data.draw(st.integers(1, 40), label="operations")):
        op = draw_operation(data, recent)
        if op[0] == "store":
            _, rank, tier, parent, blocks = op
            assert index.apply_stored(rank, tier, parent, blocks) == model.store(rank, tier, parent, blocks)
        elif op[0] == "remove":
            _, rank, tier, hashes = op
            index.apply_removed(rank, tier, hashes)
            model.remove(rank, tier, hashes)
        elif op[0] == "clear":
            index.apply_cleared(op[1])
            model.clear(op[1])
        else:
            index.remove_worker(op[1])
            model.remove_worker(op[1])
        assert index.check() == [], op
        for query in QUERIES[-8:]:
            assert index.find_matches(query) == model.find_matches(query), (op, query)
    for query in QUERIES:
        assert index.find_matches(query) == model.find_matches(query), query
    for rank, tier in product(RANKS, Tier):
        assert index.block_count(rank, tier) == model.count(rank, tier)
    restored = KvIndex.from_snapshot(json.loads(json.dumps(index.to_snapshot())))
    assert restored.to_snapshot() == index.to_snapshot()
    for query in QUERIES:
        assert restored.find_matches(query) == index.find_matches(query)
    if index.block_count(tier=DEV) == 0:
        assert index.node_count() == 0
