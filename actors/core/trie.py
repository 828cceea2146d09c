# cython: annotation_typing=False
"""Per-rank reference-counted prefix trie of active prompt blocks.

A block shared by several live requests on one rank is one trie position, so it is counted once
(the reference's structural reference counting). Positions are keyed by path, not by hash alone:
``[2, 3]`` after ``[1, 2, 3]`` sits under another root and is counted again, exactly as the
reference counts non-prefix-consistent input. Hashes are the reference's u64 (the API and the hashing
module hand over unsigned ones, and the journal holds only those); a position is keyed by its hash modulo
2**64, so an out-of-range int cannot fail the compiled build where the pure one goes on.

Representation, typed for Cython by ``trie.pxd`` (README "Compiled hot paths"; the same source runs as pure
Python and is the oracle the compiled module is tested against): positions are node ids (ints) in flat typed
arrays (parent, hash, pass count: how many live requests pass through the node), found through an
open-addressing table of node ids (``node_table.py``: the same table code as the KV index's), verified by
``(parent node, hash)``. A node's table slot comes from its *path hash*, a u64 mix of the hashes on its path
from the root (``_link``), not from its parent's node id: so every slot a walk will probe is known from the
hashes alone before any node is found, and the compiled build asks for them all at once (``_prefetch_slots`` in
``trie.pxd``) instead of waiting on one cache miss per block in turn. The path hash is only a hint where to look:
a node is the one under that parent with that hash, so two paths whose path hashes collide stay two nodes.
Every ``/add`` and ``/free`` walks a rank's trie (64 blocks each way): with a dict from ``(parent, hash)``
tuples to node ids each block cost a tuple, an int object or two and dict entries; like this, compiled, it costs
a few C loads and stores, and no Python object per node. A node whose count drops to zero has a dead subtree, so
removal frees the rest of the path in one step. Freed node ids are reused last-freed first (a list threaded through
the hash array), so ids are a function of the operations only, the same compiled and pure.

Run as Python (an install without a C compiler) this is about 15 times slower than compiled, and it is the
oracle the compiled module is tested against.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Sequence

from kvrouter.actors.core.node_table import entries as _entries
from kvrouter.actors.core.node_table import new_slots as _new_slots
from kvrouter.actors.core.node_table import resized as _resized
from kvrouter.actors.core.node_table import shift_for as _shift_for
from kvrouter.actors.core.node_table import table_add as _table_add
from kvrouter.actors.core.node_table import table_remove as _table_remove
from kvrouter.actors.core.node_table import u64 as _u64

ROOT = 0
_NONE = -1  # "no node": an empty table slot, the end of the free list, a free node's parent
_MIN_SLOTS = 8  # smallest node table (a power of two)
# A table this small is never shrunk: a rank's requests come and go, and one that empties and fills again
# (as busy ranks do, many times a second) would otherwise be resized all the way down and up each time.
_KEEP_SLOTS = 4096
_U64 = 0xFFFFFFFFFFFFFFFF
COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so
_GOLDEN = 0x9E3779B97F4A7C15  # path hash mixing constants (odd: multiplying by one is a bijection of u64)
_MIX = 0xBF58476D1CE4E5B9


class PrefixTrie:
    __slots__ = (
        "_arrays",
        "_count",
        "_fractions",
        "_free_head",
        "_hash",
        "_live",
        "_parent",
        "_shift",
        "_slots",
        "_used",
    )

    def __init__(self) -> None:
        # Node 0 is the root and is never freed; ``_used`` node ids have been handed out, the arrays may hold more.
        self._arrays: list[array[int]] = [
            array("i", [_NONE]),  # parent node; _NONE for the root and for free nodes
            array("Q", [0]),  # block hash; for a free node, 1 + the next free node (0: the last)
            array("i", [0]),  # pass count: live requests passing through the node (0: free)
        ]
        self._parent, self._hash, self._count = self._arrays
        self._used = 1
        self._free_head = _NONE
        self._live = 0  # live nodes other than the root
        self._slots = _new_slots(_MIN_SLOTS)  # live nodes by (parent, hash)
        self._shift = _shift_for(_MIN_SLOTS)
        # Sparse per-node weights set by output-block decay (selection service only). A node keeps
        # its fraction when another request later shares it, as in the reference.
        self._fractions: dict[int, float] = {}

    @property
    def size(self) -> int:
        """Number of live positions == active prompt blocks on the rank."""
        return self._live

    @property
    def has_fractions(self) -> bool:
        return bool(self._fractions)

    def weighted_size(self) -> float:
        """Positions weighted by their decay fraction (exactly summed: independent of order)."""
        if not self._fractions:
            return float(self._live)
        return self._live - math.fsum(1.0 - f for f in self._fractions.values())

    def path(self, hashes: Sequence[int]) -> Iterator[int]:
        """Node ids along a live path (stops where the path ends)."""
        return iter(self._path(hashes))

    def _path(self, hashes: Sequence[int]) -> list[int]:
        nodes = []
        parent = ROOT
        path = 0
        for h in hashes:
            key = _u64(h)
            path = _link(path, key)
            node = self._child_find(parent, key, path)
            if node == _NONE:
                break
            nodes.append(node)
            parent = node
        return nodes

    def decay_exclusive_tail(self, hashes: Sequence[int], fraction: float) -> None:
        """Give ``fraction`` to the tail of this path that no other live request shares."""
        for node in reversed(self._path(hashes)):
            if self._count[node] != 1:
                break
            self._fractions[node] = fraction

    def fraction_entries(self, paths: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[str, int, float]]:
        """``(owner, depth, fraction)`` naming every fractional node by a live path through it."""
        if not self._fractions:
            return []
        seen: set[int] = set()
        entries = []
        for owner, hashes in paths:
            for depth, node in enumerate(self._path(hashes), 1):
                fraction = self._fractions.get(node)
                if fraction is not None and node not in seen:
                    seen.add(node)
                    entries.append((owner, depth, fraction))
        return entries

    def set_fraction(self, hashes: Sequence[int], depth: int, fraction: float) -> None:
        node = self._path(hashes[:depth])[-1]
        self._fractions[node] = fraction

    def insert(self, hashes: Sequence[int]) -> None:
        if COMPILED:
            _prefetch_slots(self, hashes)  # type: ignore[name-defined]  # noqa: F821 - trie.pxd, compiled only
        parent = ROOT
        path = 0
        fresh = False  # below a node made by this insert: it has no children, nothing to look for
        for h in hashes:
            key = _u64(h)
            path = _link(path, key)
            if not fresh:
                node = self._child_find(parent, key, path)
                if node != _NONE:
                    self._count[node] += 1
                    parent = node
                    continue
                fresh = True
            parent = self._new_node(parent, key, path)

    def remove(self, hashes: Sequence[int]) -> None:
        """Undo one ``insert`` of the same ``hashes`` (``KeyError`` if no live path has them)."""
        if COMPILED:
            _prefetch_slots(self, hashes)  # type: ignore[name-defined]  # noqa: F821 - trie.pxd, compiled only
        count = self._count
        parent = ROOT
        path = 0
        dead = False
        for h in hashes:
            key = _u64(h)
            path = _link(path, key)
            node = self._child_find(parent, key, path)
            if node == _NONE:
                raise KeyError(f"no live trie path through block hash {h} (remove of a path never inserted)")
            if dead:
                # Below a node that only this request held: the rest of the path was ours alone.
                self._free_node(node, path)
            else:
                remaining = count[node] - 1
                if remaining:
                    count[node] = remaining
                else:
                    self._free_node(node, path)
                    dead = True
            parent = node

    def overlap_depth(self, hashes: Sequence[int]) -> int:
        """Length of the longest prefix of ``hashes`` that is a live root-anchored path."""
        parent = ROOT
        path = 0
        depth = 0
        for h in hashes:
            key = _u64(h)
            path = _link(path, key)
            node = self._child_find(parent, key, path)
            if node == _NONE:
                break
            depth += 1
            parent = node
        return depth

    def check(self) -> list[str]:
        """The node arrays, the table, the free list and the fractions name the same live nodes."""
        problems = []
        live = [node for node in range(1, self._used) if self._parent[node] != _NONE]
        free: list[int] = []
        node = self._free_head
        while node != _NONE and len(free) < self._used:
            free.append(node)
            node = self._hash[node] - 1
        if len(live) != self._live or len(live) + len(free) != self._used - 1 or set(live) & set(free):
            problems.append("trie nodes and pass counts disagree")
        entries = _entries(self._slots)
        if sorted(entries) != live:
            problems.append("trie node table and live nodes disagree")
        else:
            paths = self._path_hashes(live)
            if paths is None:
                problems.append("trie parent links do not lead every live node to the root")
            elif any(self._child_find(self._parent[n], self._hash[n], paths[n]) != n for n in live):
                problems.append("trie node not found under its parent and hash")
        if any(self._count[n] <= 0 for n in live):
            problems.append("trie node kept with no request passing through it")
        if any(self._parent[n] != ROOT and self._count[n] > self._count[self._parent[n]] for n in live):
            problems.append("trie node passed by more requests than its parent")
        if not set(self._fractions) <= set(live):
            problems.append("decay fraction on a trie node that is gone")
        if any(not 0.0 <= f <= 1.0 for f in self._fractions.values()):
            problems.append("decay fraction outside [0, 1]")
        return problems

    def _path_hashes(self, live: list[int]) -> dict[int, int] | None:
        """Each live node's path hash, from its parent links (None when a link leads elsewhere than the root)."""
        known = {ROOT: 0}
        for n in live:
            chain: list[int] = []
            m = n
            while m not in known:
                if m == _NONE or m >= self._used or len(chain) >= self._used:
                    return None
                chain.append(m)
                m = self._parent[m]
            path = known[m]
            for c in reversed(chain):
                path = _link(path, self._hash[c])
                known[c] = path
        return known

    # ----------------------------------------------------------------------------------- nodes

    def _new_node(self, parent: int, key: int, path: int) -> int:
        """A live node under ``parent`` with hash ``key`` (u64), path hash ``path`` and one request passing through
        it."""
        node = self._free_head
        if node != _NONE:
            following = self._hash[node]
            self._free_head = following - 1
        else:
            node = self._used
            if node == len(self._parent):
                self._grow_nodes()
            self._used = node + 1
        self._parent[node] = parent
        self._hash[node] = key
        self._count[node] = 1
        if (self._live + 1) * 4 > len(self._slots) * 3:
            self._slots, self._shift = _resized(self._slots, len(self._slots) * 2)
        _table_add(self._slots, self._shift, path >> 33, node)
        self._live += 1
        return node

    def _free_node(self, node: int, path: int) -> None:
        """Take a live node (path hash ``path``) out of the table and onto the free list (its children are the
        caller's)."""
        _table_remove(self._slots, self._shift, path >> 33, node)
        self._live -= 1
        if self._live * 16 < len(self._slots) and len(self._slots) > _KEEP_SLOTS:
            self._slots, self._shift = _resized(self._slots, len(self._slots) // 2)
        if self._fractions:
            self._fractions.pop(node, None)
        self._parent[node] = _NONE
        self._count[node] = 0
        self._hash[node] = self._free_head + 1
        self._free_head = node

    def _grow_nodes(self) -> None:
        """Room for a quarter more nodes: new arrays (the typed views of the old ones cannot resize them)."""
        extra = len(self._parent) // 4 + 64
        self._arrays = [a + array(a.typecode, [0]) * extra for a in self._arrays]
        self._parent, self._hash, self._count = self._arrays

    # ----------------------------------------------------------------------------- node table
    # Open addressing over entries ``(tag << 32) | node``: ``node_table.py``, shared with the KV index, says how.
    # A node's tag is the top 31 bits of its path hash.

    def _child_find(self, parent: int, key: int, path: int) -> int:
        """The live node under ``parent`` with hash ``key`` (u64), whose path hash is ``path``, or ``_NONE``."""
        tag = path >> 33
        slots = self._slots
        wrap = len(slots) - 1
        i = tag >> self._shift
        while True:
            entry = slots[i]
            if entry == _NONE:
                return _NONE
            if entry >> 32 == tag:
                node = entry & 0x7FFFFFFF
                if self._hash[node] == key and self._parent[node] == parent:
                    return node
            i = (i + 1) & wrap


def _link(path: int, key: int) -> int:
    """The path hash of the child with hash ``key`` (u64) of a node whose path hash is ``path`` (the root's: 0)."""
    return ((((path * _GOLDEN) & _U64) ^ key) * _MIX) & _U64
