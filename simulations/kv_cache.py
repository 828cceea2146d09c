"""A simulated worker's KV cache: fixed capacity in blocks, prefix caching, LRU eviction, KV events.

Full blocks are cached under their sequence hash (the chained hash of the prefix up to and including
the block, as the router computes it) and published with an engine-side external hash, as vLLM does:
``BlockStored`` when a block is filled, ``BlockRemoved`` when a cached block is evicted to make room,
``AllBlocksCleared`` when the worker restarts. A block referenced by a running request is *active*;
when its last request ends it becomes *inactive*: still cached (a later request can hit it), and the
first to go when room is needed, least recently used first. A partly filled block is private to its
request (``private``) and is never cached.

Events are appended to ``events`` in the order they happen; the engine hands them out once per pass.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

ENGINE_HASH_MASK = 0x9E37_79B9_7F4A_7C15  # external (engine) hashes differ from the router's, as vLLM's do


def external_hash(sequence_hash: int) -> int:
    """The engine's name for a block: a one-to-one function of its sequence hash (so of its whole prefix),
    other than the router's local hash, which names the block's own tokens only."""
    return sequence_hash ^ ENGINE_HASH_MASK


class KvCache:
    __slots__ = ("capacity", "events", "evicted", "lru", "private", "refs", "stored")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # sequence hash -> running requests holding it (cached blocks)
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.private = 0  # allocated blocks not (yet) cached: partial blocks of running requests
        self.events: list[KvEvent] = []
        self.stored = 0  # blocks published as stored (counters for the report)
        self.evicted = 0

    # -- reads ------------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return len(self.refs) + self.private

    @property
    def active(self) -> int:
        """Blocks held by running requests (cached ones they reference, plus their private ones)."""
        return len(self.refs) - len(self.lru) + self.private

    def available(self) -> int:
        """Blocks a new allocation can get: free ones plus evictable (inactive) cached ones."""
        return self.capacity - self.used + len(self.lru)

    def prefix_hits(self, sequence_hashes: list[int], limit: int) -> int:
        """How many leading blocks of a prompt are cached here (no side effects)."""
        refs = self.refs
        hits = 0
        for key in sequence_hashes[:limit]:
            if key not in refs:
                break
            hits += 1
        return hits

    # -- writes -----------------------------------------------------------------------------------

    def acquire(self, key: int) -> None:
        """A request starts to hold a cached block (a prefix hit, or a block it filled that was cached already)."""
        count = self.refs[key]
        if count == 0:
            del self.lru[key]
        self.refs[key] = count + 1

    def allocate(self, count: int) -> bool:
        """Give ``count`` private blocks, evicting LRU inactive ones as needed; False (nothing done) if too few."""
        if count <= 0:
            return True
        free = self.capacity - self.used
        if free < count:
            if free + len(self.lru) < count:
                return False
            evicted = []
            lru, refs = self.lru, self.refs
            for _ in range(count - free):
                key, _ = lru.popitem(last=False)
                del refs[key]
                evicted.append(external_hash(key))
            self.evicted += len(evicted)
            self.events.append(BlockRemoved(tuple(evicted)))
        self.private += count
        return True

    def fill(self, key: int) -> bool:
        """One private block is now full with content ``key``: cache it. Returns False if it was cached
        already (the request then holds the cached copy and the private block is released)."""
        self.private -= 1
        count = self.refs.get(key)
        if count is not None:
            self.acquire(key)
            return False
        self.refs[key] = 1
        return True

    def release(self, keys: list[int], private: int) -> None:
        """A request lets go of its blocks. Last block first, so a prompt's tail is evicted before its head."""
        self.private -= private
        refs, lru = self.refs, self.lru
        for key in reversed(keys):
            count = refs[key] - 1
            refs[key] = count
            if count == 0:
                lru[key] = None

    def publish_stored(self, keys: list[int], parent: int | None, token_ids: list[int], block_size: int) -> None:
        """One ``BlockStored`` for consecutive blocks filled by one request (``parent`` is the block before them)."""
        self.stored += len(keys)
        self.events.append(
            BlockStored(
                tuple(external_hash(k) for k in keys),
                None if parent is None else external_hash(parent),
                tuple(token_ids),
                block_size,
            )
        )

    def clear(self) -> None:
        """The worker restarted: everything is gone (running requests must have been dropped first)."""
        self.refs.clear()
        self.lru.clear()
        self.private = 0
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
