# Types and C helpers for the Cython build of hashing.py (README "Compiled hot paths"). The .py is the whole
# implementation and runs as it is when nothing is compiled; compiled, a block's local hash is one C call to
# XXH3 (the xxhash package's own C function, found at import and checked against xxh3_64_intdigest) over the
# packed token ids, instead of a Python call on a memoryview slice.
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM


cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object item, int *overflow) except? -1
    unsigned long long PyLong_AsUnsignedLongLongMask(object item) except? <unsigned long long>-1
    int _PyLong_Sign(object item)
    size_t _PyLong_NumBits(object item) except? <size_t>-1


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
    """XXH3 of each of ``count`` windows of ``block_size + extra_token`` tokens, stride ``block_size`` (``count``
    is at least 1: the caller returns early for none)."""
    return _hash_windows(&tokens[0], count, block_size, extra_token, seed)


cdef inline list _native_hashes_of(object token_ids, Py_ssize_t count, Py_ssize_t block_size,
                                   Py_ssize_t extra_token, unsigned long long seed):
    """``_native_hashes`` straight from a tuple or list of token ids (no array built first), or None when one
    of the ids it covers is not an int in [0, 2**32): the caller then converts them as before (and fails as
    before)."""
    cdef Py_ssize_t n = count * block_size + extra_token
    cdef unsigned int *packed
    if n > len(token_ids):
        return None
    packed = <unsigned int *>PyMem_Malloc(<size_t>n * sizeof(unsigned int))
    if packed == NULL:
        raise MemoryError()
    try:
        if not (_pack_tuple(token_ids, n, packed) if type(token_ids) is tuple else _pack_list(token_ids, n, packed)):
            return None
        return _hash_windows(packed, count, block_size, extra_token, seed)
    finally:
        PyMem_Free(packed)


cdef inline bint _pack_tuple(tuple token_ids, Py_ssize_t n, unsigned int *packed):
    cdef Py_ssize_t i
    for i in range(n):
        if not _pack_one(token_ids[i], &packed[i]):
            return False
    return True


cdef inline bint _pack_list(list token_ids, Py_ssize_t n, unsigned int *packed):
    cdef Py_ssize_t i
    for i in range(n):
        if not _pack_one(token_ids[i], &packed[i]):
            return False
    return True


cdef inline bint _pack_one(object item, unsigned int *slot):
    """Store ``item`` if it is an int in [0, 2**32) (no exception raised or caught on this path: each costs)."""
    cdef int overflow = 0
    cdef long long value
    if type(item) is not int:
        return False
    value = PyLong_AsLongLongAndOverflow(item, &overflow)
    if overflow or value < 0 or value >= (<long long>1) << 32:  # (a literal 0xFFFFFFFF compares as a Python int)
        return False
    slot[0] = <unsigned int>value
    return True


cdef inline list _hash_windows(const unsigned int *tokens, Py_ssize_t count, Py_ssize_t block_size,
                               Py_ssize_t extra_token, unsigned long long seed):
    cdef list out = [None] * count
    cdef size_t width = <size_t>(block_size + extra_token) * 4
    cdef Py_ssize_t i
    for i in range(count):
        out[i] = _xxh3(&tokens[i * block_size], width, seed)
    return out


cdef inline tuple _native_pairs(tuple external, const unsigned int[::1] tokens, Py_ssize_t count,
                                Py_ssize_t block_size, unsigned long long seed):
    """``(external[i], XXH3 of block i)`` for the first ``count`` blocks, as one tuple of pairs (the caller checked
    that ``external`` and ``tokens`` hold that many)."""
    cdef list out = [None] * count
    cdef size_t width = <size_t>block_size * 4
    cdef Py_ssize_t i
    for i in range(count):
        out[i] = (external[i], _xxh3(&tokens[i * block_size], width, seed))
    return tuple(out)


cdef inline list _native_chain(object block_hashes, unsigned long long seed):
    """``sequence_hashes`` with one C call to XXH3 per link, or None when a hash is not an int in [0, 2**64)
    (the caller then takes the Python path, which masks such values)."""
    cdef Py_ssize_t n = len(block_hashes)
    cdef Py_ssize_t i
    cdef unsigned long long pair[2]
    cdef list out = [None] * n
    cdef object item
    cdef tuple as_tuple = block_hashes if type(block_hashes) is tuple else tuple(block_hashes)
    for i in range(n):
        item = as_tuple[i]
        if type(item) is not int or not _u64_of(item, &pair[1]):
            return None
        if i == 0:
            pair[0] = pair[1]
        else:
            pair[0] = _xxh3(pair, 16, seed)
        out[i] = pair[0]
    return out


cdef inline bint _u64_of(object item, unsigned long long *slot):
    """Store the int ``item`` if it is in [0, 2**64), raising nothing: a 64-bit hash is often past 2**63, so
    it is read as a mask once ``_PyLong_Sign`` and the bit length say it fits."""
    if _PyLong_Sign(item) < 0 or _PyLong_NumBits(item) > 64:
        return False
    slot[0] = PyLong_AsUnsignedLongLongMask(item)
    return True


cdef inline tuple _native_prompt_hashes_packed(const unsigned int[::1] tokens, Py_ssize_t count,
                                               Py_ssize_t block_size, unsigned long long seed,
                                               unsigned long long chain_seed):
    """``_native_prompt_hashes`` of token ids already packed (the ``array("I")`` a ``/select`` body's reader
    makes): each block's XXH3 straight from the array's buffer, and the chain's link as it goes."""
    cdef Py_ssize_t i
    cdef unsigned long long pair[2]
    cdef tuple local = PyTuple_New(count)
    cdef tuple chained = PyTuple_New(count)
    cdef object value
    for i in range(count):
        pair[1] = _xxh3(&tokens[i * block_size], <size_t>block_size * 4, seed)
        pair[0] = pair[1] if i == 0 else _xxh3(pair, 16, chain_seed)
        value = pair[1]
        Py_INCREF(value)
        PyTuple_SET_ITEM(local, i, value)
        value = pair[0]
        Py_INCREF(value)
        PyTuple_SET_ITEM(chained, i, value)
    return (local, chained)


cdef inline tuple _native_prompt_hashes(object token_ids, Py_ssize_t count, Py_ssize_t block_size,
                                        unsigned long long seed, unsigned long long chain_seed):
    """(block hashes, sequence hashes) of the first ``count`` full blocks of a tuple or list of token ids, as
    tuples, in one pass: each block's XXH3 and the chain's link as it goes. None when a token id is not an int in
    [0, 2**32) (the caller takes the general path, which fails as before)."""
    cdef Py_ssize_t n = count * block_size
    cdef Py_ssize_t i
    cdef unsigned int *packed
    cdef unsigned long long pair[2]
    cdef list local = [None] * count
    cdef list chained = [None] * count
    if n > len(token_ids):
        return None
    packed = <unsigned int *>PyMem_Malloc(<size_t>max(n, 1) * sizeof(unsigned int))
    if packed == NULL:
        raise MemoryError()
    try:
        if not (_pack_tuple(token_ids, n, packed) if type(token_ids) is tuple else _pack_list(token_ids, n, packed)):
            return None
        for i in range(count):
            pair[1] = _xxh3(&packed[i * block_size], <size_t>block_size * 4, seed)
            local[i] = pair[1]
            pair[0] = pair[1] if i == 0 else _xxh3(pair, 16, chain_seed)
            chained[i] = pair[0]
    finally:
        PyMem_Free(packed)
    return (tuple(local), tuple(chained))
