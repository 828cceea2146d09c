"""How much one client may make a service hold: the caps, in one place, with why each is that big.

Every cap is checked before anything is journaled (a refused request changes nothing) and never
during recovery, so changing a cap can never make an existing journal unreadable. README's
"Limits" section documents them; beyond one, the API answers a 4xx ``{"error"}`` naming the cap.
"""

from __future__ import annotations

from typing import Final

# Ranks of one worker (slot tracker ``dp_size``, selection service ``data_parallel_size``): the
# reference slot tracker's own cap, enough for one 4,096-rank worker. Beyond it: 400.
MAX_RANKS_PER_WORKER: Final = 4096

# Ranks of one (model, tenant) scope, all its workers together: a 4,096-rank cluster in a single
# scope, twice over, so a rolling replacement of every worker still fits. Each rank costs ~700 bytes
# idle and one row of every /loads. Beyond it: 409 (the scope is full; unregister workers first).
MAX_RANKS_PER_SCOPE: Final = 8192

# Ranks of the whole service, every scope together: eight full scopes (~45 MiB idle), so many scopes cannot
# each fill up to the per-scope cap. A selection-service worker with no rank counts as one. Beyond it: 409.
MAX_RANKS_PER_SERVICE: Final = 65_536

# (model, tenant) scopes of one service: each is an actor with its own mailbox and state, and a scope name
# is client input. Beyond it: 409 (a new scope is refused; existing ones go on).
MAX_SCOPES: Final = 10_000

# Blocks of one scope's KV-event index (every rank and tier; a block two ranks hold counts twice), the
# default of ``--max-index-blocks-per-scope``: 8 Mi blocks, ~2.6 GiB at the measured ~336 bytes per
# indexed block (README, Benchmarks). Beyond it the index evicts (``actors/core/index_bounds.py``).
MAX_INDEX_BLOCKS_PER_SCOPE: Final = 8 * 1024 * 1024

# Active requests of one (model, tenant) scope (the slot tracker's ``/add`` and every selection-service
# booking, all ranks together): 1 Mi requests. Each is held until it is freed or expires (~260 bytes in the
# core without its hashes, measured with tracemalloc 2026-11-24, and its journal record); without a cap one
# client could book without end. Beyond it: 409 (free requests first).
MAX_ACTIVE_REQUESTS_PER_SCOPE: Final = 1024 * 1024

# Prompt blocks held by one scope's active requests (the sum of their ``sequence_hashes`` lengths; a block
# two requests hold counts twice): 8 Mi blocks, as ``MAX_INDEX_BLOCKS_PER_SCOPE``; ~76 bytes each in the core
# (tracemalloc, as above: the hash, its place in the request and its rank's prefix trie) and 8+ bytes of
# journal. Counted as requests come and go (``SlotTracking.prompt_blocks``). Beyond it: 409.
MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE: Final = 8 * 1024 * 1024

# Catalog records of one selection-service scope (a record with data_parallel_size 0 holds no rank,
# so ranks alone would not bound them). Beyond it: 409.
MAX_WORKERS_PER_SCOPE: Final = 8192

# One string of a request body: ids, model and tenant names, endpoints, taints, map keys. A scope
# key is written into every journal record of its scope. Beyond it: 413.
MAX_TEXT_BYTES: Final = 4096

# Taints and topology domains of one catalog record (each string capped as above). Beyond: 413.
MAX_TAINTS: Final = 256
MAX_TOPOLOGY_DOMAINS: Final = 256

# Blocks of one prompt: hash lists (``sequence_hashes``, ``block_hashes``) and ``token_ids`` once cut
# into blocks. 262,144 blocks are a 4 Mi-token prompt at block size 16 (256 Ki tokens at page size
# 1); booking one costs ~200 ms of the scope's time and ~40 MiB until it is freed. Beyond it: 413.
MAX_PROMPT_BLOCKS: Final = 262_144

# ``token_ids`` of one prompt: 4 Mi tokens (more than an 8 MiB body can carry as JSON). Beyond: 413.
MAX_PROMPT_TOKENS: Final = 4 * 1024 * 1024


def text_too_long(value: str) -> bool:
    """More than ``MAX_TEXT_BYTES`` bytes of UTF-8 (encoding only when the length alone cannot tell)."""
    length = len(value)
    if length <= MAX_TEXT_BYTES // 4:
        return False
    return length > MAX_TEXT_BYTES or len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES
