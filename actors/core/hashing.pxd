# Types and C helpers for the Cython build of hashing.py (README "Compiled hot paths"). The .py is the whole
# implementation and runs as it is when nothing is compiled; compiled, a block's local hash is one C call to
# XXH3 (the xxhash package's own C function, found at import and checked against xxh3_64_intdigest) over the
# packed token ids, instead of a Python call on a memoryview slice.
cdef extern from *:
    """
    typedef unsigned long long (*kvrouter_xxh3_fn)(const void *, size_t, unsigned long long);
    """
    ctypedef unsigned long long (*kvrouter_xxh3_fn)(const void *, size_t, unsigned long long) noexcept nogil

cdef kvrouter_xxh3_fn _xxh3


cdef inline bint _bind_xxh3(size_t address) noexcept:
    """Bind ``_xxh3`` to the C function at ``address`` (0: unbind)."""
    global _xxh3
    _xxh3 = <kvrouter_xxh3_fn>address
    return address != 0


cdef inline unsigned long long _native_digest(const unsigned char[::1] data, unsigned long long seed):
    if data.shape[0] == 0:
        return _xxh3(b"", 0, seed)
    return _xxh3(&data[0], <size_t>data.shape[0], seed)


cdef inline list _native_hashes(const unsigned int[::1] tokens, Py_ssize_t count, Py_ssize_t block_size,
                                Py_ssize_t extra_token, unsigned long long seed):
    """XXH3 of each of ``count`` windows of ``block_size + extra_token`` tokens, stride ``block_size``."""
    cdef list out = [None] * count
    cdef size_t width = <size_t>(block_size + extra_token) * 4
    cdef Py_ssize_t i
    for i in range(count):
        out[i] = _xxh3(&tokens[i * block_size], width, seed)
    return out
