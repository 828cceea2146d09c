# Types for the Cython build of trie.py (README "Compiled hot paths"). The .py is the whole implementation and
# runs as it is when nothing is compiled; this file only says which names are C integers, typed arrays and
# extension classes, so insert, remove and the node table compile to C loops. ``_free_node`` returns an int and says
# ``except -1``, ``_child_find`` (``_NONE``, -1, when absent) ``except -2``: callers test the value they got instead
# of asking CPython whether an exception is pending after every call. ``_link`` and ``_prefetch_slots`` are C only.
cimport cython

from kvrouter.actors.core.node_table cimport entries as _entries, mask_u64 as _mask_u64, new_slots as _new_slots, \
    prefetch as _prefetch, resized as _resized, shift_for as _shift_for, table_add as _table_add, \
    table_remove as _table_remove, u64 as _u64

cdef bint COMPILED
cdef unsigned long long _U64
cdef unsigned long long _GOLDEN
cdef unsigned long long _MIX
cdef int _NONE
cdef Py_ssize_t _MIN_SLOTS
cdef Py_ssize_t _KEEP_SLOTS


@cython.final
cdef class PrefixTrie:
    cdef list _arrays
    cdef int[::1] _parent
    cdef unsigned long long[::1] _hash
    cdef int[::1] _count
    cdef int _used
    cdef int _free_head
    cdef Py_ssize_t _live
    cdef long long[::1] _slots
    cdef int _shift
    cdef dict _fractions

    @cython.locals(parent=int, node=int, key="unsigned long long", path="unsigned long long")
    cdef list _path(self, hashes)

    @cython.locals(parent=int, node=int, key="unsigned long long", path="unsigned long long", fresh=bint)
    cpdef void insert(self, hashes)

    @cython.locals(count="int[::1]", parent=int, node=int, remaining=int, dead=bint, key="unsigned long long",
                   path="unsigned long long")
    cpdef void remove(self, hashes)

    @cython.locals(parent=int, node=int, depth=Py_ssize_t, key="unsigned long long", path="unsigned long long")
    cpdef Py_ssize_t overlap_depth(self, hashes)

    @cython.locals(node=int, following="long long")
    cdef int _new_node(self, int parent, unsigned long long key, unsigned long long path)

    cdef int _free_node(self, int node, unsigned long long path) except -1

    cdef void _grow_nodes(self)

    @cython.locals(slots="long long[::1]", wrap=Py_ssize_t, i=Py_ssize_t, node=int, tag="long long",
                   entry="long long")
    cdef int _child_find(self, int parent, unsigned long long key, unsigned long long path) except -2


cdef inline unsigned long long _link(unsigned long long path, unsigned long long key) noexcept


cdef enum:
    # How many blocks of a walk ``_prefetch_slots`` asks for ahead of it (a prompt is usually 64 blocks or fewer; a
    # longer walk is asked for in its first ones, the rest found as before).
    _PREFETCH_BLOCKS = 128


cdef inline void _prefetch_slots(PrefixTrie trie, object hashes) noexcept:
    """Ask the memory system for the table slot of each block of the walk over ``hashes`` before the walk needs
    it: the slots come from the path hashes, known from the hashes alone (no effect on results)."""
    cdef long long[::1] slots = trie._slots
    cdef int shift = trie._shift
    cdef unsigned long long path = 0
    cdef Py_ssize_t n = 0
    cdef object h
    for h in hashes:
        if type(h) is not int or n == _PREFETCH_BLOCKS:
            return
        path = _link(path, _mask_u64(h))
        _prefetch(&slots[<Py_ssize_t>((path >> 33) >> shift)])
        n += 1


