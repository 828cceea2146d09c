# Types for the Cython build of kv_index.py (README "Compiled hot paths"). The .py is the whole implementation and
# runs as it is when nothing is compiled; this file only says which names are C integers, typed arrays and
# extension classes, so the node tables and the store and match loops compile to C. Functions that return nothing
# return an int and say ``except -1``, and the finds (``_NONE``, -1, when absent) ``except -2``: the caller then
# tests the value it got instead of asking CPython whether an exception is pending after every call.
cimport cython

from kvrouter.actors.core.node_table cimport child_tag as _child_tag, entries as _entries, mask_u64 as _mask_u64, \
    new_slots as _new_slots, prefetch as _prefetch, resized as _resized, shift_for as _shift_for, \
    table_add as _table_add, table_remove as _table_remove, u64 as _u64

cdef bint COMPILED
cdef int _NONE
cdef Py_ssize_t _MIN_SLOTS


@cython.final
cdef class _Rank:
    cdef public object rank
    cdef public object bit
    cdef public object mask
    cdef public long long[::1] slots
    cdef public int shift
    cdef public Py_ssize_t count
    cdef public dict renamed
    cdef public list lower


@cython.final
cdef class KvIndex:
    cdef list _arrays
    cdef int[::1] _depth
    cdef readonly int[::1] _first
    cdef int[::1] _next
    cdef readonly int[::1] _parent
    cdef int[::1] _prev
    cdef unsigned long long[::1] _local
    cdef unsigned long long[::1] _name
    cdef readonly list _cover
    cdef list _free_nodes
    cdef long long[::1] _slots
    cdef int _shift
    cdef Py_ssize_t _live
    cdef readonly dict _ranks
    cdef list _by_bit
    cdef list _bits_free
    cdef dict _lower_ranks
    cdef public Py_ssize_t _blocks

    @cython.locals(node=int, nxt=int, pos=Py_ssize_t, n_query=Py_ssize_t, cover=list, r=_Rank, dev=Py_ssize_t,
                   last=int, key_parent=object)
    cpdef dict find_matches(self, local_hashes)

    @cython.locals(existing=_Rank, r=_Rank, node=int, nxt=int, moved=int, ext="unsigned long long",
                   local="unsigned long long", cover=list, held=object)
    cdef bint _store_device(self, rank, parent_hash, blocks)

    @cython.locals(node=int, head=int)
    cdef int _new_node(self, int parent, unsigned long long local, unsigned long long name)

    @cython.locals(parent=int, prev=int, nxt=int)
    cdef int _free(self, int node) except -1

    @cython.locals(first="int[::1]", nxt="int[::1]", order=list, stack=list, node=int, c=int, cover=list)
    cdef int _truncate(self, _Rank r, int top) except -1

    @cython.locals(parent="int[::1]")
    cdef bint _is_ancestor_or_self(self, int candidate, int node)

    @cython.locals(slots="long long[::1]", wrap=Py_ssize_t, i=Py_ssize_t, node=int, tag="long long",
                   entry="long long")
    cpdef int _child_find(self, int parent, unsigned long long local) except -2

    cdef int _child_add(self, int node) except -1

    cdef int _child_remove(self, int node) except -1

    cdef unsigned long long _ext_of(self, _Rank r, int node)

    @cython.locals(runs=list, names=dict, node=int, n=int, stack=list, blocks=list, kids=list)
    cdef object _device_runs(self, _Rank r)

    @cython.locals(kids=list, c=int)
    cdef list _covered_children(self, _Rank r, int node)

    @cython.locals(slots="long long[::1]", wrap=Py_ssize_t, i=Py_ssize_t, node=int, tag="long long",
                   entry="long long")
    cpdef int _ext_find(self, _Rank r, unsigned long long ext) except -2

    cpdef int _ext_add(self, _Rank r, unsigned long long ext, int node) except -1

    cpdef int _ext_remove(self, _Rank r, unsigned long long ext, int node) except -1


@cython.locals(mix="unsigned long long", m64="unsigned long long")
cdef long long _ext_tag(unsigned long long ext)

cdef Py_ssize_t _SMALL_DISTINCT
cdef unsigned long long[::1] _SCRATCH

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, held="unsigned long long[::1]", ext="unsigned long long",
               parent="unsigned long long", seen=set)
cpdef bint _distinct(parent_hash, blocks, bint pairs=*) except -1


cdef inline void _prefetch_store(KvIndex index, _Rank r, object blocks, int node) noexcept:
    """Prefetch the slots a store of ``blocks`` under ``node`` will probe: the rank's table by external hash, and
    the child table by (parent, local hash) with the parents the new nodes will get (the free list's last ids,
    then fresh ones), as when the store extends a chain. Both tables are far larger than the caches: probed one
    block after another, each block waits for two memory reads; asked for together, the reads overlap. A hint
    only: a wrong guess (an existing block, a table that grows) costs a wasted read, never a different result."""
    if type(blocks) is not tuple and type(blocks) is not list:
        return
    cdef long long[::1] rank_slots = r.slots
    cdef long long[::1] child_slots = index._slots
    cdef list free = index._free_nodes
    cdef Py_ssize_t n_free = len(free)
    cdef Py_ssize_t fresh = len(index._cover)
    cdef Py_ssize_t k = 0
    cdef long long parent = node
    cdef object pair
    for pair in blocks:
        if type(pair) is not tuple or len(<tuple>pair) != 2:
            return
        ext_obj = (<tuple>pair)[0]
        local_obj = (<tuple>pair)[1]
        if type(ext_obj) is not int or type(local_obj) is not int:
            return
        _prefetch(&rank_slots[_ext_tag(_mask_u64(ext_obj)) >> r.shift])
        _prefetch(&child_slots[_child_tag(<unsigned long long>parent, _mask_u64(local_obj)) >> index._shift])
        parent = <int>free[n_free - 1 - k] if k < n_free else fresh + (k - n_free)
        k += 1
