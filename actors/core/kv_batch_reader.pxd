# Types for the Cython build of kv_batch_reader.py (README "Compiled hot paths"). The .py is the whole
# implementation; this file only says which names are C integers and typed views, so the byte walk and the
# token loop compile to C.
cimport cython

cdef object U64_MASK
cdef bytes _STORED
cdef bytes _REMOVED
cdef bytes _CLEARED
cdef int _NIL
cdef object _ZERO_TOKEN


@cython.final
cdef class _Reader:
    cdef const unsigned char[::1] buf
    cdef Py_ssize_t pos
    cdef Py_ssize_t end
    cdef Py_ssize_t last_start

    @cython.locals(b="long long")
    cdef long long byte(self) noexcept

    @cython.locals(value="long long", i=Py_ssize_t)
    cdef long long be(self, Py_ssize_t size) noexcept

    @cython.locals(b="long long")
    cdef long long array_header(self) noexcept

    @cython.locals(b="long long")
    cdef long long map_header(self) noexcept

    @cython.locals(b="long long", size="long long", count="long long", key="long long", is_map=bint,
                   _i="long long")
    cdef bint skip(self, int depth) except -1

    cdef bint utf8_ok(self) except -1

    cdef bint nil(self) noexcept

    @cython.locals(b="long long", size="long long", start=Py_ssize_t)
    cdef object string(self)

    @cython.locals(b="long long", v="long long")
    cdef long long u32(self) noexcept

    @cython.locals(b="long long", v="long long", wide="unsigned long long", i=Py_ssize_t)
    cdef object hash64(self)

    @cython.locals(count="long long", out=list, _i="long long")
    cdef object hashes(self)

    @cython.locals(count="long long", i="long long", t="long long", b="long long", pos=Py_ssize_t, end=Py_ssize_t,
                   buf="const unsigned char[::1]", view="unsigned int[::1]")
    cdef object tokens(self)

    cdef tuple optional_str(self)

    @cython.locals(b="long long")
    cdef tuple optional_int(self)


@cython.locals(reader=_Reader, top="long long", count="long long", events=list, _i="long long")
cpdef object read_batch(data)

@cython.locals(b="long long", size="long long")
cdef object _number(_Reader reader)

@cython.locals(size="long long", block_size="long long")
cdef object _event(_Reader reader)

cdef dict _KEY_BITS
cdef int _MAX_SKIP_DEPTH

@cython.locals(pairs="long long", block_size="long long", seen="long long", bit="long long", _i="long long",
               ok=bint)
cdef object _map_event(_Reader reader)

cdef tuple _optional_hash(_Reader reader)
