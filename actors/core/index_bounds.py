"""The KV-event index of a scope stays under its block cap (``--max-index-blocks-per-scope``).

Pure. Policy, decided before a batch is applied and journaled with it, so replaying the journal gives the
same index whatever the cap is at the next start:

* A batch counts every block it stores as new (an upper bound: re-stored blocks are rare). When the index
  plus that would pass the cap, ranks are trimmed, the rank holding the most blocks first (ties: the lowest
  worker id, then dp rank), each by at least an eighth of what it holds, so trims are rare (one per eighth of
  a rank's blocks) and their O(rank blocks) cost is spread over the blocks that follow.
* A trim drops the rank's lower-tier edges, then its deepest device blocks (``KvIndex.trim_plan``). The
  heaviest rank first, because a publisher that never reports removals (or floods) is the one that grows:
  it pays, and the others keep their index. Deepest first, because a prompt's tail is its own while the
  shallow blocks are the prefixes many prompts share (system prompts, few-shot examples); covered sets
  stay prefix-closed. Evicting a block from the router's index is safe: the worker still holds it, the
  router only predicts a smaller overlap for it.
* What still does not fit (a single batch larger than the whole cap) is not stored: ``KvBlocksRefused``.

So the index never holds more than the cap after a decision. Trimmed and refused blocks are counted by the
shell (``actors/index_counters.py``) and shown per worker in ``/workers``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrouter.actors.core.events import KvBlocksRefused, KvIndexTrimmed, KvOp, KvStoredOp
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import KvIndex

TRIM_FRACTION = 8  # a trimmed rank drops at least 1/TRIM_FRACTION of its blocks
# Several batches of a rank decided together (one IngestKvBatch with ``following``) store at most 1/RUN_FRACTION of
# the cap between them (a lone batch may store more; the shell splits longer runs): the room they need then fits in
# what the heaviest rank of a full index (of up to RUN_FRACTION ranks) holds, so grouping trims the heaviest ranks
# as deciding the batches one by one would, and a batch is refused blocks only when it alone is over the cap.
RUN_FRACTION = 16


def run_block_limit(cap: int) -> int:
    """The most blocks a run of several batches may store (``RUN_FRACTION``)."""
    return cap // RUN_FRACTION


def incoming_blocks(ops: Iterable[KvOp]) -> int:
    """Blocks the ops store, counted as if all were new."""
    return sum(len(op.blocks) for op in ops if isinstance(op, KvStoredOp))


def make_room(index: KvIndex, cap: int, incoming: int) -> tuple[tuple[KvIndexTrimmed, ...], int]:
    """The trims that leave room for ``incoming`` more blocks under ``cap``, and how many of them then fit."""
    held = index.block_count()
    need = held + incoming - cap
    trims: list[KvIndexTrimmed] = []
    if need > 0:
        heaviest = sorted(index.rank_totals().items(), key=lambda item: (-item[1], item[0]))
        for rank, count in heaviest:
            if need <= 0 or count == 0:
                break
            keep_depth, freed = index.trim_plan(rank, max(need, -(-count // TRIM_FRACTION)))
            trims.append(KvIndexTrimmed(rank.worker_id, rank.dp_rank, keep_depth, freed))
            held -= freed
            need -= freed
    return tuple(trims), min(incoming, max(0, cap - held))


def fit_ops(ops: Sequence[KvOp], room: int) -> tuple[tuple[KvOp, ...], int]:
    """``ops`` with their stores cut after ``room`` blocks (a store keeps its first blocks: a chain's prefix is
    a chain); removals and clears are kept. Returns the ops and how many blocks were cut."""
    kept: list[KvOp] = []
    refused = 0
    for op in ops:
        if isinstance(op, KvStoredOp):
            take = min(room, len(op.blocks))
            room -= take
            refused += len(op.blocks) - take
            if take == len(op.blocks):
                kept.append(op)
            elif take:
                kept.append(KvStoredOp(op.tier, op.parent_hash, op.blocks[:take]))
        else:
            kept.append(op)
    return tuple(kept), refused


def refused_event(rank: WorkerRank, blocks: int) -> tuple[KvBlocksRefused, ...]:
    return (KvBlocksRefused(rank.worker_id, rank.dp_rank, blocks),) if blocks else ()
