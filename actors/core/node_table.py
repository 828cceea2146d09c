# cython: annotation_typing=False
"""Open-addressing tables of node ids: how the KV index (``kv_index.py``) and the prefix trie (``trie.py``) find a
node by its key without a dict entry and a key object per node (README "Compiled hot paths").

A table is a power-of-two ``array("q")`` of entries ``(tag << 32) | node`` (``-1`` = empty), at most three
quarters full, probed linearly. The tag is the top 31 bits of the key's 64-bit hash and the home slot the tag's
top bits (``shift``), so probing compares tags and reads a node's key (kept by the owner, in its node arrays)
only when they match, and growing or removing never reads a key. Removal shifts the following entries back (no
tombstones), so a table is a function of its history, the same compiled and pure. Finding is the owner's: only
it knows where a node's key is.

Typed for Cython by ``node_table.pxd``, which ``kv_index.pxd`` and ``trie.pxd`` cimport: compiled, the two
modules call these as C functions; as plain Python (the oracle the tests compare with) they import them.
"""

from __future__ import annotations

from array import array

_NONE = -1  # an empty slot
COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so


def new_slots(size: int) -> array[int]:
    """An empty table of ``size`` (a power of two) slots."""
    return array("q", [_NONE]) * size


def shift_for(size: int) -> int:
    """A table of ``size`` = 2**k slots homes a 31-bit tag at its top k bits."""
    return 31 - (size.bit_length() - 1)


def entries(slots: array[int]) -> list[int]:
    """The node ids in a table, in slot order."""
    return [slots[i] & 0x7FFFFFFF for i in range(len(slots)) if slots[i] != _NONE]


def table_add(slots: array[int], shift: int, tag: int, node: int) -> None:
    """Enter ``node`` under ``tag`` (the caller keeps the table under three quarters full)."""
    wrap = len(slots) - 1
    i = tag >> shift
    while slots[i] != _NONE:
        i = (i + 1) & wrap
    slots[i] = (tag << 32) | node


def table_remove(slots: array[int], shift: int, tag: int, node: int) -> None:
    """Take out ``node``, entered under ``tag``, and move back the entries that probed past it."""
    wrap = len(slots) - 1
    hole = tag >> shift
    entry = (tag << 32) | node
    while slots[hole] != entry:
        hole = (hole + 1) & wrap
    i = hole
    while True:
        i = (i + 1) & wrap
        moving = slots[i]
        if moving == _NONE:
            break
        home = (moving >> 32) >> shift
        if (i - home) & wrap >= (i - hole) & wrap:  # its home is not after the hole: it may move back
            slots[hole] = moving
            hole = i
    slots[hole] = _NONE


def resized(old: array[int], size: int) -> tuple[array[int], int]:
    """A table of ``size`` slots holding ``old``'s entries, and its shift."""
    table = new_slots(size)
    slots = table  # compiled: a typed view of it
    shift = shift_for(size)
    wrap = size - 1
    for j in range(len(old)):
        entry = old[j]
        if entry != _NONE:
            i = (entry >> 32) >> shift
            while slots[i] != _NONE:
                i = (i + 1) & wrap
            slots[i] = entry
    return table, shift


def u64(value: int) -> int:
    """``value`` modulo 2**64: hashes are u64 but may be handed over signed or too wide. Compiled: one C call
    (CPython's ``PyLong_AsUnsignedLongLongMask``, declared in ``node_table.pxd``), no int object made. The KV index
    and the trie key their nodes by it."""
    if COMPILED:
        return mask_u64(value)  # type: ignore[name-defined,no-any-return]  # noqa: F821 - node_table.pxd, compiled only
    return value & 0xFFFFFFFFFFFFFFFF


def child_tag(parent: int, key: int) -> int:
    """Tag of the child ``(parent node, key hash)``: the top 31 bits of a multiplicative hash (same in C)."""
    golden = 0x9E3779B97F4A7C15
    mix = 0xBF58476D1CE4E5B9
    m64 = 0xFFFFFFFFFFFFFFFF
    return (((key ^ ((parent * golden) & m64)) * mix) & m64) >> 33
