"""Per-rank reference-counted prefix trie of active prompt blocks.

A block shared by several live requests on one rank is one trie position, so it is counted once
(the reference's structural reference counting). Positions are keyed by path, not by hash alone:
``[2, 3]`` after ``[1, 2, 3]`` sits under another root and is counted again, exactly as the
reference counts non-prefix-consistent input.

Layout: a flat dict from ``(parent node id, hash)`` to a node id, and a dict of pass counts (how
many live requests pass through each node). Flat int-keyed dicts rather than a dict per node,
because container-per-node tries make CPython's cyclic GC walk every node again and again (a
64-block insert cost ~170 µs that way; ~15 µs like this). A node whose count drops to zero has a
dead subtree, so removal cuts the rest of the path in one step.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0


class PrefixTrie:
    __slots__ = ("_counts", "_next_id", "_nodes")

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}  # (parent id, hash) -> node id
        self._counts: dict[int, int] = {}  # node id -> live requests passing through it
        self._next_id = ROOT + 1

    @property
    def size(self) -> int:
        """Number of live positions == active prompt blocks on the rank."""
        return len(self._counts)

    def insert(self, hashes: Sequence[int]) -> None:
        nodes, counts = self._nodes, self._counts
        parent = ROOT
        for h in hashes:
            key = (parent, h)
            node = nodes.get(key)
            if node is None:
                node = self._next_id
                self._next_id = node + 1
                nodes[key] = node
                counts[node] = 1
            else:
                counts[node] += 1
            parent = node

    def remove(self, hashes: Sequence[int]) -> None:
        """Undo one ``insert`` of the same ``hashes``."""
        nodes, counts = self._nodes, self._counts
        parent = ROOT
        dead = False
        for h in hashes:
            key = (parent, h)
            node = nodes[key]
            if dead:
                # Below a node that only this request held: the rest of the path was ours alone.
                del nodes[key], counts[node]
            else:
                remaining = counts[node] - 1
                if remaining:
                    counts[node] = remaining
                else:
                    del nodes[key], counts[node]
                    dead = True
            parent = node

    def overlap_depth(self, hashes: Sequence[int]) -> int:
        """Length of the longest prefix of ``hashes`` that is a live root-anchored path."""
        nodes = self._nodes
        parent = ROOT
        depth = 0
        for h in hashes:
            node = nodes.get((parent, h))
            if node is None:
                break
            depth += 1
            parent = node
        return depth
