# cython: annotation_typing=False
"""The per-scope KV block index: which (worker, dp_rank) holds which prompt prefixes, per storage tier.

Semantics (behaviour.md#the-kv-index, #overlap-and-tiers, and black-box probes of the 1.6.1 indexer):

* **Device tier** is a radix tree of *positions*: a position is a path of local block hashes from
  the root, so the same local hash under two different prefixes is two positions. A rank covers a
  position when it stored a block there. A store starts at the root or at the rank's own block
  named by ``parent`` (an external hash); an unknown parent rejects the whole store. Removing a
  block drops the rank from that position **and every descendant** (1.6.1 does this too: after
  removing B from A-B-C and storing B again, only A-B matches). Hence every rank's covered set is
  prefix-closed, which is what makes matching a single walk.
* **Lower tiers** (host, disk, external) are continuation edges, not trees: an edge says "after
  the block with external hash P (or at the root), local hash L is held as external hash E". The
  parent need not be known (typically it is a device block), removal drops one edge only, and a
  removed-then-restored edge reconnects whatever continued it (both as in 1.6.1).
* **Overlap** per rank, chained: ``device`` = leading query blocks covered on device; the host
  walk starts right after them, from the rank's external hash of the last device block (or from
  the root when ``device == 0``) and follows host edges for ``host_ext`` blocks; the disk walk
  starts where the host walk stopped, from the last external hash reached so far, and yields
  ``disk_ext``; the external tier continues after disk the same way for ``external_ext``. Each
  tier only ever extends the match, so ``device + host_ext + disk_ext + external_ext`` is the
  rank's deepest position. (behaviour.md#overlap-and-tiers says "continuing the prefix beyond the device match"; the
  chaining through host then disk then external, and keying by the previous tier's *external*
  hash, was confirmed on 1.6.1: a host chain that re-names A-B with other external hashes does
  not extend a device A-B match.)

Representation, chosen for millions of blocks, and typed for Cython by ``kv_index.pxd`` (README "Compiled
hot paths"; the same source runs as pure Python, and is the oracle the compiled module is tested against):
device positions are node ids (ints) in flat typed arrays; children are found through an open-addressing
table of node ids whose keys, ``(parent node, local hash)``, are read back from the node arrays, so a node
costs eight bytes of table (its id and a hash tag) rather than a dict entry and a key object. Which ranks
cover a node is an int bitmask (the rank's own mask object while one rank covers it), so ``find_matches``
is one table probe and one mask compare per query block, independent of the number of ranks. Per rank, a
table of the same kind finds a node from the rank's external hash; the way back is the node's name (the
external hash it was created with, in a flat array) unless the rank named it otherwise (a small per-rank
dict of such renames, empty when ranks agree on the hash of the same content, as engines do). Lower-tier
edges are per-rank dicts keyed ``((parent + 1) << 64) | local``.

Pathological inputs 1.6.1 handles differently (engines hash blocks by content, so these need a
producer that reuses an external hash for other content): storing an external hash the rank
already holds at another position *moves* it (the old position and its descendants are dropped
for that rank, and the store stops if the old position is on the path being stored); storing a
second external hash at a position the rank already covers renames it (the old name is
forgotten). 1.6.1 keeps stale aliases instead. Keeping one name per (rank, position) is what
lets snapshots and dumps rebuild the index exactly.
"""

from __future__ import annotations

import enum
import heapq
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import attrs

from kvrouter.actors.core.ids import U64_MASK, WorkerRank
from kvrouter.actors.core.node_table import child_tag as _child_tag
from kvrouter.actors.core.node_table import entries as _entries
from kvrouter.actors.core.node_table import new_slots as _new_slots
from kvrouter.actors.core.node_table import resized as _resized
from kvrouter.actors.core.node_table import shift_for as _shift_for
from kvrouter.actors.core.node_table import table_add as _table_add
from kvrouter.actors.core.node_table import table_remove as _table_remove
from kvrouter.actors.core.node_table import u64 as _u64

SNAPSHOT_VERSION = 1
COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so
_NONE = -1  # "no node" in the sibling links, and an empty slot of a node table
_MIN_SLOTS = 8  # smallest node table (a power of two)


class Tier(enum.IntEnum):
    """Where a block lives on its worker; lower tiers only extend a device match (behaviour.md#overlap-and-tiers)."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    EXTERNAL = 3

    @property
    def label(self) -> str:
        """The reference's ``storage_tier`` spelling, as ``/dump`` reports it."""
        return _TIER_LABELS[self]


_TIER_LABELS = {Tier.DEVICE: "device", Tier.HOST: "host_pinned", Tier.DISK: "disk", Tier.EXTERNAL: "external"}
_LOWER_TIERS = (Tier.HOST, Tier.DISK, Tier.EXTERNAL)


class Overlap(NamedTuple):
    """Blocks of one query a rank can serve: the device prefix, then each lower tier's extension."""

    device: int
    host_ext: int = 0
    disk_ext: int = 0
    external_ext: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host_ext + self.disk_ext + self.external_ext


@attrs.frozen
class StoredRun:
    """One dumped store: ``blocks`` are ``(external_hash, local_hash)`` pairs chained from ``parent_hash``."""

    rank: WorkerRank
    tier: Tier
    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]


class _Lower:
    """One rank's continuation edges in one lower tier; ``edges`` and ``by_ext`` are inverses."""

    __slots__ = ("by_ext", "edges")

    def __init__(self) -> None:
        self.edges: dict[int, int] = {}  # ((parent_ext + 1) << 64 | local), root parent = 0  ->  ext
        self.by_ext: dict[int, int] = {}  # ext -> edge key


class _Rank:
    """Everything one (worker, dp_rank) holds. Its external hash of a node it covers is ``renamed[node]``
    if there, else the node's name (``KvIndex._name``); ``slots`` finds the node from that hash (a table of
    ``count`` node ids; see "node tables" in ``KvIndex``)."""

    __slots__ = ("bit", "count", "lower", "mask", "rank", "renamed", "shift", "slots")

    def __init__(self, rank: WorkerRank, bit: int) -> None:
        self.rank = rank
        self.bit = bit
        self.mask = 1 << bit
        self.slots = _new_slots(_MIN_SLOTS)
        self.shift = _shift_for(_MIN_SLOTS)
        self.count = 0  # device blocks held
        self.renamed: dict[int, int] = {}  # node -> this rank's external hash, where it is not the node's name
        self.lower: list[_Lower | None] = [None, None, None]  # HOST, DISK, EXTERNAL

    def lower_count(self) -> int:
        return sum(len(t.by_ext) for t in self.lower if t is not None)


class KvIndex:
    """Block index of one scope. Mutated only by its owning actor; not thread-safe, not copied."""

    __slots__ = (
        "_arrays",
        "_bits_free",
        "_blocks",
        "_by_bit",
        "_cover",
        "_depth",
        "_first",
        "_free_nodes",
        "_live",
        "_local",
        "_lower_ranks",
        "_name",
        "_next",
        "_parent",
        "_prev",
        "_ranks",
        "_shift",
        "_slots",
    )

    def __init__(self) -> None:
        # Device radix tree; node 0 is the root and is never freed. The node arrays hold room for more nodes
        # than exist (``len(self._cover)`` node ids are in use); ``_arrays`` keeps them as arrays for growing.
        self._arrays: list[array[int]] = [
            array("i", [_NONE]),  # parent node
            array("Q", [0]),  # local hash
            array("Q", [0]),  # name: the external hash the node was created with (see _Rank.renamed)
            array("i", [_NONE]),  # first child
            array("i", [_NONE]),  # next sibling
            array("i", [_NONE]),  # previous sibling
            array("i", [0]),  # depth: blocks from the root to the node (1 = stored at the root); trims cut by it
        ]
        self._parent, self._local, self._name, self._first, self._next, self._prev, self._depth = self._arrays
        self._cover: list[int] = [0]  # bitmask of rank bits covering the node
        self._free_nodes: list[int] = []
        self._slots = _new_slots(_MIN_SLOTS)  # live nodes other than the root, by (parent, local hash)
        self._shift = _shift_for(_MIN_SLOTS)
        self._live = 0
        # Ranks.
        self._ranks: dict[WorkerRank, _Rank] = {}
        self._by_bit: list[_Rank | None] = []
        self._bits_free: list[int] = []  # heap: reuse the lowest bit, so the layout is a function of history
        self._lower_ranks: dict[WorkerRank, _Rank] = {}  # ranks holding any lower-tier edge
        self._blocks = 0  # every rank's blocks in every tier, kept as they change (the cap is checked per batch)

    # ----------------------------------------------------------------------------------- writes

    def apply_stored(
        self,
        rank: WorkerRank,
        tier: Tier,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
        distinct: bool = False,
    ) -> bool:
        """Store ``blocks`` (``(external_hash, local_hash)`` pairs, parent first) for ``rank`` in ``tier``.

        Returns False, storing nothing, when the device parent is unknown for the rank or the event
        names one external hash twice (including the parent). Re-storing held blocks is a no-op.
        ``distinct=True`` says the caller has checked the hashes are distinct already (a store KV ingest decided
        on: ``kv_wire.stored_blocks`` checked them), so they are not compared again.
        """
        if blocks and not distinct and not _distinct(parent_hash, blocks):
            return False
        if tier is Tier.DEVICE:
            return self._store_device(rank, parent_hash, blocks)
        if blocks:
            r = self._rank(rank)
            lower = r.lower[tier - 1]
            if lower is None:
                lower = r.lower[tier - 1] = _Lower()
            self._lower_ranks[rank] = r
            before = len(lower.by_ext)
            _store_lower(lower, parent_hash, blocks)
            self._blocks += len(lower.by_ext) - before
        return True

    def apply_removed(self, rank: WorkerRank, tier: Tier, block_hashes: Iterable[int]) -> int:
        """Drop blocks by external hash; returns how many were known (unknown ones are skipped)."""
        r = self._ranks.get(rank)
        if r is None:
            return 0
        removed = 0
        if tier is Tier.DEVICE:
            for ext in block_hashes:
                node = self._ext_find(r, _u64(ext))
                if node != _NONE:
                    self._truncate(r, node)
                    removed += 1
            return removed
        lower = r.lower[tier - 1]
        if lower is None:
            return 0
        for ext in block_hashes:
            key = lower.by_ext.pop(ext & U64_MASK, None)
            if key is not None:
                del lower.edges[key]
                removed += 1
        self._blocks -= removed
        if not lower.by_ext:
            r.lower[tier - 1] = None
            if all(t is None for t in r.lower):
                self._lower_ranks.pop(rank, None)
        return removed

    def apply_cleared(self, rank: WorkerRank) -> None:
        """Forget every block of this (worker, dp_rank) in every tier; other ranks are untouched."""
        r = self._ranks.get(rank)
        if r is None:
            return
        parent = self._parent
        for node in [n for n in self._rank_nodes(r) if parent[n] == 0]:
            self._truncate(r, node)
        self._drop_lower(r)

    def remove_rank(self, rank: WorkerRank) -> None:
        """Clear the rank and release its bit (unregistration of one dp rank)."""
        r = self._ranks.get(rank)
        if r is None:
            return
        self.apply_cleared(rank)
        del self._ranks[rank]
        self._by_bit[r.bit] = None
        heapq.heappush(self._bits_free, r.bit)

    def trim(self, rank: WorkerRank, keep_depth: int | None) -> int:
        """Drop the rank's lower-tier edges and its device blocks deeper than ``keep_depth`` (None: keep every
        device block); returns how many blocks it dropped. Covered sets stay prefix-closed: only whole subtrees go.
        """
        r = self._ranks.get(rank)
        if r is None:
            return 0
        before = r.count + r.lower_count()
        self._drop_lower(r)
        if keep_depth is not None:
            depth, cut = self._depth, keep_depth + 1
            for node in [n for n in self._rank_nodes(r) if depth[n] == cut]:
                self._truncate(r, node)
        return before - r.count

    def trim_plan(self, rank: WorkerRank, at_least: int) -> tuple[int | None, int]:
        """The shallowest cut of ``trim`` that drops ``at_least`` of the rank's blocks (or all of them):
        ``(keep_depth, blocks it drops)``. Lower-tier edges go first (they only extend a device match), then
        the deepest device blocks (a prompt's own tail; the shallow ones are the prefixes prompts share)."""
        r = self._ranks.get(rank)
        if r is None:
            return None, 0
        freed = r.lower_count()
        if freed >= at_least:
            return None, freed
        per_depth: dict[int, int] = {}
        depth = self._depth
        for node in self._rank_nodes(r):
            d = depth[node]
            per_depth[d] = per_depth.get(d, 0) + 1
        keep = max(per_depth, default=0)
        while keep > 0 and freed < at_least:
            freed += per_depth.get(keep, 0)
            keep -= 1
        return keep, freed

    def remove_worker(self, worker_id: int) -> None:
        """Remove every dp rank of ``worker_id``."""
        for rank in [k for k in self._ranks if k.worker_id == worker_id]:
            self.remove_rank(rank)

    # ------------------------------------------------------------------------------------ reads

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerRank, Overlap]:
        """Overlap of every rank with a non-zero match for the query's local block hashes (taken as u64).

        One walk down the device tree: the covering mask can only shrink along a path (covered
        sets are prefix-closed), so a rank's depth is where its bit leaves the mask.
        """
        depth: dict[int, tuple[int, int]] = {}  # bit -> (device blocks, last device node)
        cover = self._cover
        n_query = len(local_hashes)
        if n_query:
            node = self._child_find(0, _u64(local_hashes[0]))
            if node != _NONE:
                active = cover[node]
                pos = 1
                while pos < n_query:
                    nxt = self._child_find(node, _u64(local_hashes[pos]))
                    if nxt == _NONE:
                        break
                    mask = cover[nxt]
                    if mask != active:
                        _record(depth, active ^ mask, pos, node)
                        if not mask:
                            active = 0
                            break
                        active = mask
                    node = nxt
                    pos += 1
                if active:
                    _record(depth, active, pos, node)
        by_bit = self._by_bit
        out: dict[WorkerRank, Overlap] = {}
        for bit, (dev, _last) in depth.items():
            r = by_bit[bit]
            if r is not None and r.rank not in self._lower_ranks:
                out[r.rank] = Overlap(dev)
        for rank, r in self._lower_ranks.items():
            dev, last = depth.get(r.bit, (0, 0))
            pos = dev
            key_parent = 0  # a Python int: the edge keys below exceed 64 bits
            if dev:
                key_parent = self._ext_of(r, last)
                key_parent += 1
            ext_counts = [0, 0, 0]
            for i, lower in enumerate(r.lower):
                if lower is None or pos >= n_query:
                    continue
                edges = lower.edges
                start = pos
                while pos < n_query:
                    ext = edges.get((key_parent << 64) | (local_hashes[pos] & U64_MASK))
                    if ext is None:
                        break
                    key_parent = ext + 1
                    pos += 1
                ext_counts[i] = pos - start
            if pos:
                out[rank] = Overlap(dev, ext_counts[0], ext_counts[1], ext_counts[2])
        return out

    def block_count(self, rank: WorkerRank | None = None, tier: Tier | None = None) -> int:
        """Blocks held (a block held by two ranks counts twice), optionally for one rank and/or tier."""
        if rank is None and tier is None:
            return self._blocks
        ranks = self._ranks.values() if rank is None else [r for r in (self._ranks.get(rank),) if r is not None]
        total = 0
        for r in ranks:
            if tier is None:
                total += r.count + r.lower_count()
            elif tier is Tier.DEVICE:
                total += r.count
            else:
                lower = r.lower[tier - 1]
                total += len(lower.by_ext) if lower is not None else 0
        return total

    def rank_totals(self) -> dict[WorkerRank, int]:
        """Blocks each rank holds, every tier together (ranks that hold nothing included)."""
        return {rank: r.count + r.lower_count() for rank, r in self._ranks.items()}

    def rank_block_counts(self) -> dict[WorkerRank, dict[Tier, int]]:
        """Per rank (sorted), blocks held per tier; ranks that hold nothing are omitted."""
        out: dict[WorkerRank, dict[Tier, int]] = {}
        for rank in sorted(self._ranks):
            r = self._ranks[rank]
            counts = {Tier.DEVICE: r.count} if r.count else {}
            for tier, lower in zip(_LOWER_TIERS, r.lower, strict=True):
                if lower is not None:
                    counts[tier] = len(lower.by_ext)
            if counts:
                out[rank] = counts
        return out

    def node_count(self) -> int:
        """Live device positions (shared by all ranks that cover them); for metrics and tests."""
        return self._live

    def ranks(self) -> list[WorkerRank]:
        return sorted(self._ranks)

    def is_empty(self) -> bool:
        """No rank holds a block in any tier."""
        return all(not r.count and all(t is None for t in r.lower) for r in self._ranks.values())

    # ------------------------------------------------------------------------------- invariants

    def check(self) -> list[str]:
        """Structural invariants, as messages (empty when sound). O(nodes + blocks): tests and simulations.

        The fast paths rely on every one of them: ``find_matches`` on prefix-closed covered sets and exact
        cover masks, ``_truncate`` on the sibling links, dumps and snapshots on the per-rank node tables.
        """
        problems: list[str] = []
        free = set(self._free_nodes)
        live = {n for n in range(1, len(self._cover)) if n not in free}
        if len(free) != len(self._free_nodes) or 0 in free:
            problems.append("free list repeats a node or holds the root")
        if any(len(a) < len(self._cover) for a in self._arrays):
            problems.append("a node array is shorter than the nodes in use")
        self._check_ranks(problems)
        self._check_tree(live, problems)
        covered: dict[int, int] = {}
        for r in self._ranks.values():
            problems.extend(self._check_rank(r, live, covered))
            for i, lower in enumerate(r.lower):
                if lower is not None:
                    problems.extend(_check_lower(r.rank, _LOWER_TIERS[i], lower))
        for node in live:
            if self._cover[node] != covered.get(node, 0):
                problems.append(
                    f"node {node}: cover mask {self._cover[node]:#x} != its ranks {covered.get(node, 0):#x}"
                )
            if not self._cover[node]:
                problems.append(f"node {node} is covered by no rank but not freed (leak)")
        for node in free:
            if self._parent[node] != _NONE:
                problems.append(f"freed node {node} still names a parent")
        counted = sum(r.count + r.lower_count() for r in self._ranks.values())
        if self._blocks != counted:
            problems.append(f"block counter {self._blocks} != {counted} blocks held")
        return problems

    def _check_ranks(self, problems: list[str]) -> None:
        used = set()
        for rank, r in self._ranks.items():
            if r.rank != rank or r.mask != 1 << r.bit:
                problems.append(f"{rank}: entry names {r.rank} with bit {r.bit} and mask {r.mask:#x}")
            if r.bit >= len(self._by_bit) or self._by_bit[r.bit] is not r:
                problems.append(f"{rank}: bit {r.bit} does not lead back to the rank")
            used.add(r.bit)
        if len(used) != len(self._ranks):
            problems.append("two ranks share a bit")
        if used & set(self._bits_free):
            problems.append("a bit in use is also free")
        empty_slots = {bit for bit, r in enumerate(self._by_bit) if r is None}
        if empty_slots != set(self._bits_free):
            problems.append("unused bits and the free-bit heap disagree")
        holders = {rank for rank, r in self._ranks.items() if any(t is not None for t in r.lower)}
        if set(self._lower_ranks) != holders or any(self._lower_ranks[k] is not self._ranks.get(k) for k in holders):
            problems.append("the lower-tier rank set does not match the ranks holding lower-tier edges")

    def _check_tree(self, live: set[int], problems: list[str]) -> None:
        """The child table and the first/next/prev sibling links describe the same tree over the live nodes."""
        parent, local = self._parent, self._local
        tabled = _entries(self._slots)
        if set(tabled) != live or len(tabled) != len(live) or self._live != len(live):
            problems.append(f"child table names {len(tabled)} nodes (counted {self._live}), {len(live)} are live")
        if _shift_for(len(self._slots)) != self._shift or len(tabled) * 4 > len(self._slots) * 3:
            problems.append(f"child table of {len(self._slots)} slots is mis-sized for {len(tabled)} nodes")
        for node in live:
            if self._child_find(parent[node], local[node]) != node:
                problems.append(f"node {node}: not found in the child table under its parent and local hash")
            if self._depth[node] != self._depth[parent[node]] + 1:
                problems.append(f"node {node}: depth {self._depth[node]} is not its parent's plus one")
        children: dict[int, set[int]] = {0: set()}
        for node in live:
            children.setdefault(node, set())
            if parent[node] not in live and parent[node] != 0:
                problems.append(f"node {node}: parent {parent[node]} is not live")
            else:
                children.setdefault(parent[node], set()).add(node)
        for node, expected in children.items():
            linked, previous, child = set(), _NONE, self._first[node]
            while child != _NONE and child not in linked:
                if self._prev[child] != previous or parent[child] != node:
                    problems.append(f"node {child}: sibling links disagree under {node}")
                linked.add(child)
                previous, child = child, self._next[child]
            if linked != expected:
                problems.append(f"node {node}: sibling list holds {sorted(linked)}, children are {sorted(expected)}")

    def _check_rank(self, r: _Rank, live: set[int], covered: dict[int, int]) -> list[str]:
        """One rank's device names: one per node, found by the rank's table, renames only where they differ
        from the node's name, on live nodes, prefix-closed; adds its bit to ``covered``."""
        problems = []
        names, parent = self._name, self._parent
        listed = self._rank_nodes(r)
        nodes = set(listed)
        if len(nodes) != len(listed) or r.count != len(listed):
            problems.append(f"{r.rank}: its table lists {len(listed)} entries, {len(nodes)} nodes, counted {r.count}")
        if _shift_for(len(r.slots)) != r.shift or len(listed) * 4 > len(r.slots) * 3:
            problems.append(f"{r.rank}: table of {len(r.slots)} slots is mis-sized for {len(listed)} nodes")
        if any(self._ext_find(r, self._ext_of(r, n)) != n for n in nodes):
            problems.append(f"{r.rank}: a node is not found under the external hash the rank names it by")
        if not set(r.renamed) <= nodes or any(names[n] == e for n, e in r.renamed.items()):
            problems.append(f"{r.rank}: a rename of a node it does not hold, or one that repeats the node's name")
        for node in nodes:
            if node not in live:
                problems.append(f"{r.rank}: holds node {node}, which is not live")
                continue
            covered[node] = covered.get(node, 0) | r.mask
            if parent[node] != 0 and parent[node] not in nodes:
                problems.append(f"{r.rank}: covers node {node} but not its parent (not prefix-closed)")
        return problems

    # ------------------------------------------------------------------------ dump and snapshot

    def dump_events(self) -> list[StoredRun]:
        """Stores that rebuild this index, grouped per (worker, dp_rank, tier), parents before children.

        Device runs follow unbranched chains; children are visited in ascending external hash, so
        the output depends only on the content, not on node ids or history.
        """
        return list(self._iter_runs())

    def to_snapshot(self) -> dict[str, Any]:
        """Plain JSON form: per (worker, dp_rank, tier), runs as flat ``[parent|null, ext, local, ...]`` lists."""
        groups: list[list[Any]] = []
        for run in self._iter_runs():
            flat: list[int | None] = [run.parent_hash]
            for ext, local in run.blocks:
                flat.append(ext)
                flat.append(local)
            if (
                groups
                and groups[-1][0] == run.rank.worker_id
                and groups[-1][1] == run.rank.dp_rank
                and (groups[-1][2] == int(run.tier))
            ):
                groups[-1][3].append(flat)
            else:
                groups.append([run.rank.worker_id, run.rank.dp_rank, int(run.tier), [flat]])
        return {"v": SNAPSHOT_VERSION, "ranks": groups}

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> KvIndex:
        if data.get("v") != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported KV index snapshot version {data.get('v')!r}")
        index = cls()
        for worker_id, dp_rank, tier, runs in data["ranks"]:
            rank = WorkerRank(worker_id, dp_rank)
            for flat in runs:
                pairs = [(flat[i], flat[i + 1]) for i in range(1, len(flat), 2)]
                if not index.apply_stored(rank, Tier(tier), flat[0], pairs):
                    raise ValueError(f"snapshot run for {rank} has an unknown parent {flat[0]}")
        return index

    # -------------------------------------------------------------------------------- internals

    def _rank(self, rank: WorkerRank) -> _Rank:
        r = self._ranks.get(rank)
        if r is None:
            if self._bits_free:
                bit = heapq.heappop(self._bits_free)
            else:
                bit = len(self._by_bit)
                self._by_bit.append(None)
            r = self._ranks[rank] = _Rank(rank, bit)
            self._by_bit[bit] = r
        return r

    def _store_device(self, rank: WorkerRank, parent_hash: int | None, blocks: Sequence[tuple[int, int]]) -> bool:
        existing = self._ranks.get(rank)
        if parent_hash is None:
            node = 0
        else:
            node = self._ext_find(existing, _u64(parent_hash)) if existing is not None else _NONE
            if node == _NONE:
                return False
        if not blocks:
            return True
        r = existing if existing is not None else self._rank(rank)
        if COMPILED:  # ask for the table slots the loop will probe before it needs them (no effect on results)
            _prefetch_store(self, r, blocks, node)  # type: ignore[name-defined]  # noqa: F821 - kv_index.pxd
        rank_mask = r.mask
        cover = self._cover
        for pair in blocks:
            ext = _u64(pair[0])
            local = _u64(pair[1])
            # A node without children (a chain being extended, the common case) has none to find.
            nxt = _NONE if self._first[node] == _NONE else self._child_find(node, local)
            if nxt != _NONE and cover[nxt] & rank_mask and self._ext_of(r, nxt) == ext:
                node = nxt  # already held: idempotent
                continue
            moved = self._ext_find(r, ext)
            if moved != _NONE:  # the hash names another position of this rank: move it here
                if self._is_ancestor_or_self(moved, node):
                    break  # would cut the path being stored; keep what is stored so far
                self._truncate(r, moved)  # cannot free ``node`` or ``nxt``: neither is under ``moved``
            if nxt == _NONE:
                nxt = self._new_node(node, local, ext)
            held = cover[nxt]
            if held and held & rank_mask:  # rename: one external hash per (rank, position)
                self._ext_remove(r, self._ext_of(r, nxt), nxt)
                r.renamed.pop(nxt, None)
            else:
                cover[nxt] = held | rank_mask if held else rank_mask  # one rank: share its mask object
                self._blocks += 1
            if ext != self._name[nxt]:
                r.renamed[nxt] = ext
            self._ext_add(r, ext, nxt)
            node = nxt
        return True

    def _new_node(self, parent: int, local: int, name: int) -> int:
        if self._free_nodes:
            node = self._free_nodes.pop()
            self._cover[node] = 0
        else:
            node = len(self._cover)
            if node == len(self._parent):
                self._grow_nodes()
            self._cover.append(0)
        self._parent[node] = parent
        self._local[node] = local
        self._name[node] = name
        self._first[node] = _NONE
        self._depth[node] = self._depth[parent] + 1
        head = self._first[parent]
        self._next[node] = head
        self._prev[node] = _NONE
        if head != _NONE:
            self._prev[head] = node
        self._first[parent] = node
        self._child_add(node)
        return node

    def _grow_nodes(self) -> None:
        """Room for half as many nodes again, grown in place: the allocator extends a large block where it is (no
        copy, and no fresh pages for what is there; new arrays cost both, ~10 % of a million-block ingest). The
        typed views of the compiled index are let go first: an array cannot resize while a view holds its buffer."""
        extra = len(self._parent) // 2 + 64
        self._parent = self._local = self._name = self._first = self._next = self._prev = self._depth = None  # type: ignore[assignment]
        for a in self._arrays:
            a.frombytes(bytes(extra * a.itemsize))  # zeros
        self._parent, self._local, self._name, self._first, self._next, self._prev, self._depth = self._arrays

    def _free(self, node: int) -> None:
        self._child_remove(node)
        parent = self._parent[node]
        prev, nxt = self._prev[node], self._next[node]
        if prev == _NONE:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if nxt != _NONE:
            self._prev[nxt] = prev
        self._parent[node] = _NONE
        self._free_nodes.append(node)

    def _truncate(self, r: _Rank, top: int) -> None:
        """Drop ``r`` from ``top`` and all its descendants; free positions nobody covers any more."""
        mask = r.mask
        cover = self._cover
        first = self._first
        nxt = self._next
        order: list[int] = []
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            c = first[node]
            while c != _NONE:
                if cover[c] & mask:
                    stack.append(c)
                c = nxt[c]
        renamed = r.renamed
        for node in reversed(order):  # children before parents, so a freed parent has no live children
            self._ext_remove(r, self._ext_of(r, node), node)
            if renamed:
                renamed.pop(node, None)
            left = cover[node] ^ mask
            cover[node] = left
            if not left:
                self._free(node)
        self._blocks -= len(order)

    def _drop_lower(self, r: _Rank) -> None:
        self._blocks -= r.lower_count()
        r.lower = [None, None, None]
        self._lower_ranks.pop(r.rank, None)

    def _is_ancestor_or_self(self, candidate: int, node: int) -> bool:
        parent = self._parent
        while node > 0:
            if node == candidate:
                return True
            node = parent[node]
        return False

    # ----------------------------------------------------------------------------- node tables
    # Open addressing over entries ``(tag << 32) | node`` (``node_table.py``, shared with the prefix trie, says
    # how); finding is here, since only the index knows where a node's key is.

    def _child_find(self, parent: int, local: int) -> int:
        """The node under ``parent`` with local hash ``local`` (u64), or ``_NONE``."""
        tag = _child_tag(parent, local)
        slots = self._slots
        wrap = len(slots) - 1
        i = tag >> self._shift
        while True:
            entry = slots[i]
            if entry == _NONE:
                return _NONE
            if entry >> 32 == tag:
                node = entry & 0x7FFFFFFF
                if self._local[node] == local and self._parent[node] == parent:
                    return node
            i = (i + 1) & wrap

    def _child_add(self, node: int) -> None:
        """Enter a node whose parent and local hash are set and not yet in the table."""
        if (self._live + 1) * 4 > len(self._slots) * 3:
            self._slots, self._shift = _resized(self._slots, len(self._slots) * 2)
        _table_add(self._slots, self._shift, _child_tag(self._parent[node], self._local[node]), node)
        self._live += 1

    def _child_remove(self, node: int) -> None:
        """Take a node out of the table (before its parent link is cleared)."""
        _table_remove(self._slots, self._shift, _child_tag(self._parent[node], self._local[node]), node)
        self._live -= 1
        if self._live * 8 < len(self._slots) and len(self._slots) > _MIN_SLOTS:
            self._slots, self._shift = _resized(self._slots, len(self._slots) // 2)

    def _ext_of(self, r: _Rank, node: int) -> int:
        """The rank's external hash of a node it covers."""
        if r.renamed:
            ext = r.renamed.get(node)
            if ext is not None:
                return ext
        return self._name[node]

    def _ext_find(self, r: _Rank, ext: int) -> int:
        """The rank's node named ``ext`` (u64), or ``_NONE``."""
        tag = _ext_tag(ext)
        slots = r.slots
        wrap = len(slots) - 1
        i = tag >> r.shift
        while True:
            entry = slots[i]
            if entry == _NONE:
                return _NONE
            if entry >> 32 == tag:
                node = entry & 0x7FFFFFFF
                if self._ext_of(r, node) == ext:
                    return node
            i = (i + 1) & wrap

    def _ext_add(self, r: _Rank, ext: int, node: int) -> None:
        """Enter ``node`` under ``ext``, which the rank's table does not hold."""
        if (r.count + 1) * 4 > len(r.slots) * 3:
            r.slots, r.shift = _resized(r.slots, len(r.slots) * 2)
        _table_add(r.slots, r.shift, _ext_tag(ext), node)
        r.count += 1

    def _ext_remove(self, r: _Rank, ext: int, node: int) -> None:
        """Take ``node``, held under ``ext``, out of the rank's table."""
        _table_remove(r.slots, r.shift, _ext_tag(ext), node)
        r.count -= 1
        if r.count * 8 < len(r.slots) and len(r.slots) > _MIN_SLOTS:
            r.slots, r.shift = _resized(r.slots, len(r.slots) // 2)

    def _rank_nodes(self, r: _Rank) -> list[int]:
        """The device nodes the rank holds, in table order (a function of the rank's history)."""
        return _entries(r.slots)

    def _iter_runs(self) -> Iterator[StoredRun]:
        for rank in sorted(self._ranks):
            r = self._ranks[rank]
            if r.count:
                yield from self._device_runs(r)
            for tier, lower in zip(_LOWER_TIERS, r.lower, strict=True):
                if lower is not None:
                    for ext in sorted(lower.by_ext):
                        key = lower.by_ext[ext]
                        parent = (key >> 64) - 1
                        yield StoredRun(rank, tier, None if parent < 0 else parent, ((ext, key & U64_MASK),))

    def _device_runs(self, r: _Rank) -> Iterator[StoredRun]:
        runs: list[StoredRun] = []
        names = {node: self._ext_of(r, node) for node in self._rank_nodes(r)}
        roots = sorted((n for n in names if self._parent[n] == 0), key=names.__getitem__)
        stack: list[tuple[int | None, int]] = [(None, n) for n in reversed(roots)]
        while stack:
            parent_ext, node = stack.pop()
            blocks = []
            while True:
                blocks.append((names[node], self._local[node]))
                kids = self._covered_children(r, node)
                if len(kids) != 1:
                    break
                node = kids[0]
            here = names[node]
            kids.sort(key=names.__getitem__)
            stack.extend((here, k) for k in reversed(kids))
            runs.append(StoredRun(r.rank, Tier.DEVICE, parent_ext, tuple(blocks)))
        return iter(runs)

    def _covered_children(self, r: _Rank, node: int) -> list[int]:
        kids = []
        c = self._first[node]
        while c != _NONE:
            if self._cover[c] & r.mask:
                kids.append(c)
            c = self._next[c]
        return kids


def _ext_tag(ext: int) -> int:
    """Tag of an external hash (engines may number blocks 1, 2, 3...: mixed, not taken as is)."""
    mix = 0xBF58476D1CE4E5B9
    m64 = 0xFFFFFFFFFFFFFFFF
    return (((ext ^ (ext >> 29)) * mix) & m64) >> 33


def _check_lower(rank: WorkerRank, tier: Tier, lower: _Lower) -> list[str]:
    if not lower.by_ext:
        return [f"{rank}: empty {tier.label} tier kept instead of dropped"]
    if len(lower.edges) != len(lower.by_ext) or any(lower.edges.get(k) != e for e, k in lower.by_ext.items()):
        return [f"{rank}: {tier.label} edge maps are not inverses"]
    return []


def _record(depth: dict[int, tuple[int, int]], bits: int, pos: int, node: int) -> None:
    while bits:
        low = bits & -bits
        depth[low.bit_length() - 1] = (pos, node)
        bits ^= low


_SMALL_DISTINCT = 64  # up to this many hashes, pairwise compares (no set, no int objects when compiled)
_SCRATCH = array("Q", bytes(8 * _SMALL_DISTINCT))  # their u64 values (one index is used at a time)


def _distinct(parent_hash: int | None, blocks: Sequence[Any], pairs: bool = True) -> bool:
    """No external hash named twice among ``blocks`` (``(external, local)`` pairs, or the external hashes
    themselves when not ``pairs``) and the parent, all taken as u64."""
    n = len(blocks)
    if n > _SMALL_DISTINCT:
        seen = {_u64(b[0] if pairs else b) for b in blocks}
        if len(seen) != n:
            return False
        return parent_hash is None or _u64(parent_hash) not in seen
    held = _SCRATCH
    for i in range(n):
        ext = _u64(blocks[i][0] if pairs else blocks[i])
        for j in range(i):
            if held[j] == ext:
                return False
        held[i] = ext
    if parent_hash is not None:
        parent = _u64(parent_hash)
        for j in range(n):
            if held[j] == parent:
                return False
    return True


def distinct_hashes(parent_hash: int | None, hashes: Sequence[int]) -> bool:
    """No hash named twice among ``hashes`` and ``parent_hash`` (u64): what a store needs to be applied."""
    return _distinct(parent_hash, hashes, False)


def _store_lower(lower: _Lower, parent_hash: int | None, blocks: Sequence[tuple[int, int]]) -> None:
    edges = lower.edges
    by_ext = lower.by_ext
    key_parent = 0 if parent_hash is None else (parent_hash & U64_MASK) + 1
    for ext, local in blocks:
        ext &= U64_MASK
        key = (key_parent << 64) | (local & U64_MASK)
        held = edges.get(key)
        if held != ext:
            if held is not None:
                del by_ext[held]
            old_key = by_ext.get(ext)
            if old_key is not None:
                del edges[old_key]
            edges[key] = ext
            by_ext[ext] = key
        key_parent = ext + 1
