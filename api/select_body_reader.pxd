# Types for the Cython build of select_body_reader.py (README "Compiled hot paths"). The .py is the whole
# implementation; this file only says which names are C integers and typed views, so the byte walk and the
# token loop compile to C.
cimport cython

cdef long long _U32_END
cdef object _FAILED
cdef str _TOKEN_IDS


@cython.final
cdef class _Scanner:
    cdef bytes data
    cdef const unsigned char[::1] buf
    cdef Py_ssize_t pos
    cdef Py_ssize_t end

    @cython.locals(buf="const unsigned char[::1]", pos=Py_ssize_t, end=Py_ssize_t, b="long long")
    cdef void skip_ws(self) noexcept

    cdef long long peek(self) noexcept

    @cython.locals(buf="const unsigned char[::1]", pos=Py_ssize_t, end=Py_ssize_t, start=Py_ssize_t, b="long long")
    cdef object string(self)

    @cython.locals(size=Py_ssize_t)
    cdef bint literal(self, bytes word) except -1

    @cython.locals(buf="const unsigned char[::1]", pos=Py_ssize_t, end=Py_ssize_t, value="long long",
                   digits="long long", b="long long")
    cdef long long number(self) noexcept

    @cython.locals(data=bytes, p="const unsigned char *", pos=Py_ssize_t, end=Py_ssize_t, close=Py_ssize_t,
                   start=Py_ssize_t, count=Py_ssize_t, i=Py_ssize_t, value="long long", b="long long",
                   view="unsigned int[::1]")
    cdef object tokens(self)

    @cython.locals(b="long long", number="long long")
    cdef object value(self, str key)


cdef bint _word_byte(long long b) noexcept

cdef bint _number_tail(long long b) noexcept


@cython.locals(scanner=_Scanner, b="long long", fields=dict)
cpdef object read_select_body(data)
