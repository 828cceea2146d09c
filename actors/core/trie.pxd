# Types for the Cython build of trie.py (README "Compiled hot paths"). The .py is the whole implementation and
# runs as it is when nothing is compiled; this file only says which names are C integers, typed arrays and
# extension classes, so insert, remove and the node table compile to C loops. ``_free_node`` returns an int and says
# ``except -1``, ``_child_find`` (``_NONE``, -1, when absent) ``except -2``: callers test the value they got instead
# of asking CPython whether an exception is pending after every call.
cimport cython

from kvrouter.actors.core.node_table cimport child_tag as _child_tag, entries as _entries, new_slots as _new_slots, \
    resized as _resized, shift_for as _shift_for, table_add as _table_add, table_remove as _table_remove

cdef extern from "Python.h":
    # ``value & _U64`` for an int, in C (trie._u64)
    unsigned long long _mask_u64 "PyLong_AsUnsignedLongLongMask" (object value) except? 0xFFFFFFFFFFFFFFFF

cdef bint COMPILED
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

    @cython.locals(parent=int, node=int)
    cdef list _path(self, hashes)

    @cython.locals(parent=int, node=int, key="unsigned long long", fresh=bint)
    cpdef void insert(self, hashes)

    @cython.locals(count="int[::1]", parent=int, node=int, remaining=int, dead=bint)
    cpdef void remove(self, hashes)

    @cython.locals(parent=int, node=int, depth=Py_ssize_t)
    cpdef Py_ssize_t overlap_depth(self, hashes)

    @cython.locals(node=int, following="long long")
    cdef int _new_node(self, int parent, unsigned long long key)

    cdef int _free_node(self, int node) except -1

    cdef void _grow_nodes(self)

    @cython.locals(slots="long long[::1]", wrap=Py_ssize_t, i=Py_ssize_t, node=int, tag="long long",
                   entry="long long")
    cdef int _child_find(self, int parent, unsigned long long key) except -2


cdef unsigned long long _u64(object value) except? 0xFFFFFFFFFFFFFFFF
