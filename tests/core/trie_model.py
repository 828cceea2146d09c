"""A model of the prefix trie (``actors/core/trie.py``) kept in dicts: the tests drive both with the same random
operations and compare everything a caller sees. Written independently of the node-table trie (flat dicts from
``(parent node id, hash)`` to a node id and of pass counts), it shares no code with it; it was the slot tracker's
pure-Python trie once, and is now only the tests' model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

ROOT = 0


class PrefixTrie:
    __slots__ = ("_counts", "_fractions", "_next_id", "_nodes")

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}  # (parent id, hash) -> node id
        self._counts: dict[int, int] = {}  # node id -> live requests passing through it
        # Sparse per-node weights set by output-block decay (selection service only). A node keeps
        # its fraction when another request later shares it, as in the reference.
        self._fractions: dict[int, float] = {}
        self._next_id = ROOT + 1

    @property
    def size(self) -> int:
        """Number of live positions == active prompt blocks on the rank."""
        return len(self._counts)

    @property
    def has_fractions(self) -> bool:
        return bool(self._fractions)

    def weighted_size(self) -> float:
        """Positions weighted by their decay fraction (exactly summed: independent of order)."""
        if not self._fractions:
            return float(len(self._counts))
        return len(self._counts) - math.fsum(1.0 - f for f in self._fractions.values())

    def path(self, hashes: Sequence[int]) -> Iterator[int]:
        """Node ids along a live path (stops where the path ends)."""
        nodes = self._nodes
        parent = ROOT
        for h in hashes:
            node = nodes.get((parent, h))
            if node is None:
                return
            yield node
            parent = node

    def decay_exclusive_tail(self, hashes: Sequence[int], fraction: float) -> None:
        """Give ``fraction`` to the tail of this path that no other live request shares."""
        for node in reversed(list(self.path(hashes))):
            if self._counts[node] != 1:
                break
            self._fractions[node] = fraction

    def fraction_entries(self, paths: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[str, int, float]]:
        """``(owner, depth, fraction)`` naming every fractional node by a live path through it."""
        if not self._fractions:
            return []
        seen: set[int] = set()
        entries = []
        for owner, hashes in paths:
            for depth, node in enumerate(self.path(hashes), 1):
                fraction = self._fractions.get(node)
                if fraction is not None and node not in seen:
                    seen.add(node)
                    entries.append((owner, depth, fraction))
        return entries

    def set_fraction(self, hashes: Sequence[int], depth: int, fraction: float) -> None:
        node = list(self.path(hashes[:depth]))[-1]
        self._fractions[node] = fraction

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
        """Undo one ``insert`` of the same ``hashes`` (``KeyError`` if no live path has them)."""
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
                    parent = node
                    continue
                del nodes[key], counts[node]
                dead = True
            if self._fractions:
                self._fractions.pop(node, None)
            parent = node

    def check(self) -> list[str]:
        """The node map, the pass counts and the fractions name the same live nodes."""
        problems = []
        if set(self._nodes.values()) != set(self._counts) or len(self._nodes) != len(self._counts):
            problems.append("trie nodes and pass counts disagree")
        if any(count <= 0 for count in self._counts.values()):
            problems.append("trie node kept with no request passing through it")
        if not set(self._fractions) <= set(self._counts):
            problems.append("decay fraction on a trie node that is gone")
        if any(not 0.0 <= f <= 1.0 for f in self._fractions.values()):
            problems.append("decay fraction outside [0, 1]")
        return problems

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
