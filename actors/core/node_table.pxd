# Types for the Cython build of node_table.py (README "Compiled hot paths"). The .py is the whole implementation
# and runs as it is when nothing is compiled. kv_index.pxd and trie.pxd cimport these, so the compiled index and
# trie call them as C functions (cpdef: the pure-Python index and trie import the same names). ``table_add`` and
# ``table_remove`` return an int (0) and say ``except -1`` so their C callers test it instead of asking CPython
# whether an exception is pending after every call.
cimport cython

cdef extern from *:
    # Ask for the cache line at ``address`` ahead of its use (no effect on results); the index and the trie call it.
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define kvrouter_prefetch(address) __builtin_prefetch((const void *)(address))
    #else
    #define kvrouter_prefetch(address) ((void)(address))
    #endif
    """
    void prefetch "kvrouter_prefetch" (const void *address) noexcept nogil

cdef extern from "Python.h":
    # ``value & (2**64 - 1)`` for an int, in C (``u64``; the index and the trie ask for slots with it too)
    unsigned long long mask_u64 "PyLong_AsUnsignedLongLongMask" (object value) except? 0xFFFFFFFFFFFFFFFF

cdef bint COMPILED
cdef int _NONE

cpdef object new_slots(Py_ssize_t size)

cpdef int shift_for(size)

@cython.locals(i=Py_ssize_t)
cpdef list entries(long long[::1] slots)

@cython.locals(wrap=Py_ssize_t, i=Py_ssize_t)
cpdef int table_add(long long[::1] slots, int shift, long long tag, int node) except -1

@cython.locals(wrap=Py_ssize_t, i=Py_ssize_t, hole=Py_ssize_t, home=Py_ssize_t, entry="long long",
               moving="long long")
cpdef int table_remove(long long[::1] slots, int shift, long long tag, int node) except -1

@cython.locals(slots="long long[::1]", shift=int, wrap=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, entry="long long")
cpdef tuple resized(long long[::1] old, Py_ssize_t size)

cpdef unsigned long long u64(object value) except? 0xFFFFFFFFFFFFFFFF

@cython.locals(golden="unsigned long long", mix="unsigned long long", m64="unsigned long long")
cpdef long long child_tag(unsigned long long parent, unsigned long long key)
