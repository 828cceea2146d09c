# Types for the Cython build of select_body_reader.py (README "Compiled hot paths"). The .py is the whole
# implementation; this file only says which names are C integers and typed views, so the byte walk and the
# token loop compile to C.
cimport cython
from cpython cimport array as carray


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* How many ASCII digits start at p[pos] (stopping at close): eight bytes at a time where they are there,
       without a branch per byte (the run's end would be a mispredicted branch once per number). A byte is a
       digit when its high nibble is 3 and adding 6 keeps it so (0x3A-0x3F become 0x40-0x45); the first other
       byte is the lowest set bit (little-endian: the lowest address). A carry out of a byte only comes from a
       non-digit byte, so no byte before the first non-digit is disturbed. */
    static inline Py_ssize_t kvrouter_digit_run(const unsigned char *p, Py_ssize_t pos, Py_ssize_t close) {
        Py_ssize_t start = pos;
    #if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        while (close - pos >= 8) {
            uint64_t word, bad;
            memcpy(&word, p + pos, 8);
            bad = ((word & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL)
                | (((word + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL);
            if (bad) {
                return pos - start + (Py_ssize_t)(__builtin_ctzll(bad) >> 3);
            }
            pos += 8;
        }
    #endif
        while (pos < close && (unsigned)(p[pos] - 48) <= 9) {
            pos++;
        }
        return pos - start;
    }
    /* The value of the n (1 to 10) ASCII digits at p[start] (readable up to p[end]): eight at a time as one
       word where eight bytes can be read (the digits' values combined in pairs, fours, then eights: three
       multiplications, no chain of one per digit), else one at a time. */
    static inline long long kvrouter_digits_value(const unsigned char *p, Py_ssize_t start, Py_ssize_t n,
                                                  Py_ssize_t end) {
        long long value = 0;
        Py_ssize_t i;
    #if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (start + 8 <= end) {
            uint64_t word;
            Py_ssize_t head = n > 8 ? n - 8 : 0;
            for (i = 0; i < head; i++) {
                value = value * 10 + (p[start + i] - 48);
            }
            memcpy(&word, p + start + head, 8);
            word -= 0x3030303030303030ULL;  /* (no borrow leaves a digit byte: every digit is at least 0x30) */
            if (n < 8) {
                word <<= 8 * (8 - n);  /* the digits to the top bytes, zeros (leading zeros) below */
            }
            word = word * 10 + (word >> 8);
            word = (((word & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32)))
                    + (((word >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
            return value * 100000000LL + (long long)word;
        }
    #endif
        for (i = 0; i < n; i++) {
            value = value * 10 + (p[start + i] - 48);
        }
        return value;
    }
    """
    Py_ssize_t kvrouter_digit_run(const unsigned char *p, Py_ssize_t pos, Py_ssize_t close) noexcept nogil
    long long kvrouter_digits_value(const unsigned char *p, Py_ssize_t start, Py_ssize_t n, Py_ssize_t end) noexcept nogil


cdef carray.array _U32


cdef inline Py_ssize_t _digit_run(const unsigned char *p, Py_ssize_t pos, Py_ssize_t close) noexcept:
    return kvrouter_digit_run(p, pos, close)


cdef inline long long _digits_value(const unsigned char *p, Py_ssize_t start, Py_ssize_t n, Py_ssize_t end) noexcept:
    return kvrouter_digits_value(p, start, n, end)


cdef inline carray.array _new_u32(Py_ssize_t size):
    """An array("I") of ``size`` elements, not zeroed (every one the reader keeps is written)."""
    return carray.clone(_U32, size, False)

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

    @cython.locals(close=Py_ssize_t, room=Py_ssize_t, count=Py_ssize_t)
    cdef object tokens(self)

    @cython.locals(p="const unsigned char *", pos=Py_ssize_t, start=Py_ssize_t, count=Py_ssize_t, size=Py_ssize_t,
                   k=Py_ssize_t, value="long long")
    cdef Py_ssize_t fill(self, unsigned int[::1] view, Py_ssize_t close) noexcept

    @cython.locals(b="long long", number="long long")
    cdef object value(self, str key)


cdef bint _NATIVE

cdef bint _word_byte(long long b) noexcept

cdef bint _number_tail(long long b) noexcept


@cython.locals(scanner=_Scanner, b="long long", fields=dict)
cpdef object read_select_body(data)
