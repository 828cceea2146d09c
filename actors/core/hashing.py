"""Block and sequence hashes, bit for bit as the reference computes them (behaviour.md#hashing).

The KV index keys prompt positions by these hashes, and engines' KV events are re-hashed with the
same function, so any difference here silently turns every cache hit into a miss. Hence the
vectors pinned in ``tests/core/test_hashing.py``, checked against the 1.6.1 reference.

All values are unsigned 64-bit ints; the HTTP boundary converts to signed (``ids.to_i64``).
A request's ``cache_salt`` takes no part: the spec does not say how it would enter the hash (1.6.1
does change the hashes for a non-empty salt, so salted prompts hash differently there).
"""

from __future__ import annotations

import ctypes
import importlib
import struct
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from xxhash import xxh3_64_intdigest

from kvrouter.actors.core.ids import U64_MASK

SEED = 1337
_PAIR = struct.Struct("<QQ")
_NEEDS_SWAP = array("I", [1]).tobytes()[0] != 1  # big-endian host
COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so


def _xxh3_address() -> int:
    """Where ``XXH3_64bits_withSeed`` is: the C function of the xxhash package's own extension module (which
    ``xxh3_64_intdigest`` calls, exported there), or 0 if it cannot be found."""
    try:
        native = importlib.import_module("xxhash._xxhash")
        function = ctypes.CDLL(native.__file__).XXH3_64bits_withSeed
    except (ImportError, OSError, AttributeError):
        return 0
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def _probe_native() -> bool:
    """Whether the C function bound by ``_bind_xxh3`` hashes as ``xxh3_64_intdigest`` does: each input-length
    path of XXH3 (up to 16, 128 and 240 bytes, and longer), two seeds. A mismatch unbinds it."""
    for size in (0, 3, 8, 16, 64, 100, 200, 240, 256, 1000):
        data = bytes((i * 37 + size) & 0xFF for i in range(size))
        for seed in (SEED, 0xFFFFFFFFFFFFFFFF):
            if _native_digest(data, seed) != xxh3_64_intdigest(data, seed):  # type: ignore[name-defined]  # noqa: F821
                return False
    return True


# Compiled, each block is hashed by one C call to XXH3 over the packed token ids, not a Python call on a
# memoryview slice per block (~200 ns a block): ``hashing.pxd``'s C functions, which exist only there.
NATIVE_XXH3 = False
if COMPILED and not _NEEDS_SWAP:
    NATIVE_XXH3 = _bind_xxh3(_xxh3_address()) and _probe_native()  # type: ignore[name-defined]  # noqa: F821
    if not NATIVE_XXH3:
        _bind_xxh3(0)  # type: ignore[name-defined]  # noqa: F821


def lora_seed(lora_name: str | None) -> int:
    """The hash seed for a LoRA adapter: ``1337 + xxh3_64(name)`` (wrapping); no/empty name keeps 1337."""
    if not lora_name:
        return SEED
    return _named_seed(lora_name)


@lru_cache(maxsize=1024)
def _named_seed(lora_name: str) -> int:
    return (SEED + xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)) & U64_MASK


def _u32_array(token_ids: Sequence[int]) -> array[int]:
    """Token ids as a C array of u32; ValueError for a value that is not one."""
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _u32_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed little-endian u32 (one C-level pass instead of a struct call per block)."""
    packed = _u32_array(token_ids)
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform has a 2- or 8-byte C unsigned int
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if _NEEDS_SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def u32_token_ids(values: list[Any]) -> bool:
    """Whether every element is an int (not a bool) in ``[0, 2**32)``, as a prompt's token ids must be: one plain
    loop, which the compiled module runs at a few ns per token (a prompt's checks cost ~40 us of C-level passes
    before)."""
    for value in values:  # noqa: SIM110 - a loop compiles to C; all() over a generator would not
        if type(value) is not int or not 0 <= value <= 0xFFFFFFFF:
            return False
    return True


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_hashes_per_block: Sequence[Sequence[int] | None] | None = None,
    eagle: bool = False,
) -> list[int]:
    """Local hash of each *full* block of ``block_size`` tokens (a partial trailing block is not hashed).

    ``mm_hashes_per_block[i]``, when given and non-empty, are the multimodal hashes of block ``i``;
    they are appended sorted ascending as u64 LE, which is how the reference separates two
    prompts whose placeholder tokens are identical but whose images differ.

    ``eagle``: each block also covers the first token of the next block (windows of
    ``block_size + 1`` tokens, stride ``block_size``), so only ``(len - 1) // block_size`` blocks
    are complete.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be greater than 0, got {block_size}")
    extra_token = 1 if eagle else 0
    count = max(0, len(token_ids) - extra_token) // block_size
    if count == 0:
        return []
    seed = lora_seed(lora_name)
    if NATIVE_XXH3 and not mm_hashes_per_block:
        packed = token_ids if type(token_ids) is array and token_ids.typecode == "I" else None
        if packed is None:
            if type(token_ids) is tuple or type(token_ids) is list:  # a prompt's: packed in C as they are read
                hashed = _native_hashes_of(token_ids, count, block_size, extra_token, seed)  # type: ignore[name-defined]  # noqa: F821
                if hashed is not None:
                    return hashed  # type: ignore[no-any-return]
            packed = _u32_array(token_ids[: count * block_size + extra_token])
        return _native_hashes(packed, count, block_size, extra_token, seed)  # type: ignore[name-defined,no-any-return]  # noqa: F821
    data = memoryview(_u32_bytes(token_ids[: count * block_size + extra_token]))
    step = block_size * 4
    width = step + 4 * extra_token
    out = [xxh3_64_intdigest(data[i : i + width], seed) for i in range(0, count * step, step)]
    if mm_hashes_per_block:
        for i, mm in enumerate(mm_hashes_per_block[:count]):
            if mm:
                extra = struct.pack(f"<{len(mm)}Q", *sorted(h & U64_MASK for h in mm))
                out[i] = xxh3_64_intdigest(bytes(data[i * step : i * step + width]) + extra, seed)
    return out


def stored_pairs(
    external_hashes: Sequence[int],
    token_ids: Sequence[int],
    block_size: int,
    count: int,
    *,
    lora_name: str | None = None,
) -> tuple[tuple[int, int], ...]:
    """``(external_hashes[i], local hash of block i)`` for the first ``count`` blocks of ``token_ids``, as a KV store
    keeps them: the caller has checked that both hold at least ``count`` (full blocks). Compiled, for the token array a
    decoded batch carries, each pair is made as its block is hashed (no list of local hashes, no zip)."""
    if count <= 0:
        return ()
    if NATIVE_XXH3 and type(token_ids) is array and token_ids.typecode == "I" and type(external_hashes) is tuple:
        return _native_pairs(external_hashes, token_ids, count, block_size, lora_seed(lora_name))  # type: ignore[name-defined,no-any-return]  # noqa: F821
    local = block_hashes(token_ids[: count * block_size], block_size, lora_name=lora_name)
    return tuple(zip(external_hashes[:count], local, strict=True))


def prompt_hashes(
    token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A prompt's block hashes and their chained sequence hashes, as tuples: ``block_hashes`` then
    ``sequence_hashes`` of those (compiled, for a tuple, a list or an ``array("I")`` of token ids: in one pass,
    without the lists)."""
    if NATIVE_XXH3 and block_size > 0:
        count = len(token_ids) // block_size
        if type(token_ids) is array and token_ids.typecode == "I":  # a /select body's reader packed them already
            return _native_prompt_hashes_packed(token_ids, count, block_size, lora_seed(lora_name), SEED)  # type: ignore[name-defined,no-any-return]  # noqa: F821
        if type(token_ids) is tuple or type(token_ids) is list:
            both = _native_prompt_hashes(token_ids, count, block_size, lora_seed(lora_name), SEED)  # type: ignore[name-defined]  # noqa: F821
            if both is not None:
                return both  # type: ignore[no-any-return]
    local = block_hashes(token_ids, block_size, lora_name=lora_name)
    return tuple(local), tuple(sequence_hashes(local))


def sequence_hashes(block_hashes: Sequence[int]) -> list[int]:
    """Chained hashes: ``seq[0] = block[0]``, ``seq[i] = xxh3_64(LE(seq[i-1]) || LE(block[i]), 1337)``.

    A sequence hash names a whole prefix, so equal values mean equal prompts up to that block.
    """
    out: list[int] = []
    if not block_hashes:
        return out
    if NATIVE_XXH3 and (type(block_hashes) is tuple or type(block_hashes) is list):
        chained = _native_chain(block_hashes, SEED)  # type: ignore[name-defined]  # noqa: F821
        if chained is not None:  # None: a value to mask (not in [0, 2**64)), done below
            return chained  # type: ignore[no-any-return]
    prev = block_hashes[0] & U64_MASK
    out.append(prev)
    pack = _PAIR.pack
    for h in block_hashes[1:]:
        prev = xxh3_64_intdigest(pack(prev, h & U64_MASK), SEED)
        out.append(prev)
    return out


def next_sequence_hash(prev_sequence_hash: int, block_hash: int) -> int:
    """One step of the chain in ``sequence_hashes`` (for callers extending a known prefix)."""
    return xxh3_64_intdigest(_PAIR.pack(prev_sequence_hash & U64_MASK, block_hash & U64_MASK), SEED)
