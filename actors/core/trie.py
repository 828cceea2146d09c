"""Per-rank reference-counted prefix trie of active prompt blocks.

A block shared by several live requests on one rank is one trie position, so it is counted once
(the reference's structural reference counting). Positions are keyed by path, not by hash alone:
``[2, 3]`` after ``[1, 2, 3]`` sits under another root and is counted again, exactly as the
reference counts non-prefix-consistent input.

Each node is a two-slot list ``[pass_count, children]`` where ``pass_count`` is the number of live
requests whose prompt passes through the node. A node whose count drops to zero has a dead
subtree, so removal can cut it off in one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Node = list[Any]  # [pass_count: int, children: dict[int, Node]]


class PrefixTrie:
    __slots__ = ("_root", "size")

    def __init__(self) -> None:
        self._root: dict[int, Node] = {}
        self.size = 0  # number of live positions == active prompt blocks on the rank

    def insert(self, hashes: Sequence[int]) -> None:
        children = self._root
        for h in hashes:
            node = children.get(h)
            if node is None:
                node = [1, {}]
                children[h] = node
                self.size += 1
            else:
                node[0] += 1
            children = node[1]

    def remove(self, hashes: Sequence[int]) -> None:
        """Undo one ``insert`` of the same ``hashes``."""
        children = self._root
        for depth, h in enumerate(hashes):
            node = children[h]
            node[0] -= 1
            if node[0] == 0:
                # Only this request passed through here, so the rest of its path is this subtree.
                del children[h]
                self.size -= len(hashes) - depth
                return
            children = node[1]

    def overlap_depth(self, hashes: Sequence[int]) -> int:
        """Length of the longest prefix of ``hashes`` that is a live root-anchored path."""
        children = self._root
        depth = 0
        for h in hashes:
            node = children.get(h)
            if node is None:
                break
            depth += 1
            children = node[1]
        return depth
