"""Block and sequence hashes must equal the reference's bit for bit, or every cache hit becomes a miss.

Where each vector comes from:
* behaviour.md#hashing (docs/architecture): vectors 1.6.1 computes, probed on the released services.
* "1.6.1 select": obtained for this test from ai-dynamo-runtime 1.6.1 ``dynamo.select_service``
  (``DYN_USE_KV_EVENTS=false``): ``POST /select_and_reserve`` with ``token_ids`` returns the chained
  sequence hashes (signed i64; listed here as u64). The local block hashes listed with them were
  confirmed by asking ``POST /select`` with those ``block_hashes``/``sequence_hashes`` on the hash
  path and getting the full prompt back as device overlap (the approximate index is keyed by
  local hashes, so any wrong block hash would have cut the match).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.hashing import block_hashes, lora_seed, next_sequence_hash, sequence_hashes
from kvrouter.actors.core.ids import U64_MASK, to_i64, to_u64

TOKENS_1_16 = list(range(1, 17))
# behaviour.md#hashing
BLOCKS_1_16 = [14643705804678351452, 16777012769546811212, 483935686894639516, 135165725823939817]
SEQ_1_16 = [14643705804678351452, 4945711292740353085, 12583592247330656132, 1921452330601040443]


def test_spec_vectors_tokens_1_to_16_block_4() -> None:
    assert block_hashes(TOKENS_1_16, 4) == BLOCKS_1_16
    assert sequence_hashes(BLOCKS_1_16) == SEQ_1_16


def test_spec_appendix_tokens_0_to_15_block_16() -> None:
    assert block_hashes(list(range(16)), 16) == [15310707395893867146]


def test_partial_trailing_block_is_not_hashed() -> None:
    # 1.6.1 select: 17 tokens at block 4 gave the same 4 sequence hashes as 16 tokens.
    assert block_hashes(list(range(1, 18)), 4) == BLOCKS_1_16
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([], 4) == []


def test_lora_name_changes_the_seed() -> None:
    # behaviour.md#hashing gives the first block; 1.6.1 select gave the whole chain and confirmed the locals.
    assert block_hashes(TOKENS_1_16, 4, lora_name="alpha") == [
        4059692062493597942,
        15935668989504354300,
        18424144866122074201,
        9820854955923902825,
    ]
    assert sequence_hashes(block_hashes(TOKENS_1_16, 4, lora_name="alpha")) == [
        4059692062493597942,
        17981444235514123243,
        10073320649093446895,
        5602423923747819848,
    ]


def test_empty_lora_name_is_no_lora() -> None:
    # 1.6.1 select: lora_name "" returned the unsalted chain.
    assert block_hashes(TOKENS_1_16, 4, lora_name="") == BLOCKS_1_16
    assert lora_seed("") == lora_seed(None) == 1337


def test_non_ascii_lora_name_is_hashed_as_utf8() -> None:
    # 1.6.1 select, block 3, lora "ünï-λ"; the partial third block is dropped.
    blocks = block_hashes([5, 6, 7, 8, 9, 10, 11], 3, lora_name="ünï-λ")
    assert blocks == [14987123075647766087, 10597009924639738505]
    assert sequence_hashes(blocks) == [14987123075647766087, 5259512616956189422]


def test_several_blocks_with_a_partial_tail_block_16() -> None:
    # 1.6.1 select: 50 tokens (3 full blocks + 2), block 16.
    tokens = [(i * 7919 + 13) % 150000 for i in range(50)]
    blocks = block_hashes(tokens, 16)
    assert blocks == [11723321007336875285, 2666792838869464250, 7752177021258800169]
    assert sequence_hashes(blocks) == [11723321007336875285, 2703124656375945542, 6111243657236017554]


def test_token_ids_are_u32_little_endian() -> None:
    # 1.6.1 select: extreme u32 values, block 3.
    blocks = block_hashes([4294967295, 0, 2147483648, 7, 8, 9, 100000, 1, 2, 3], 3)
    assert blocks == [3148507773729730500, 560734302779673188, 12258847978330076982]
    assert sequence_hashes(blocks) == [3148507773729730500, 8819908844553257109, 15953637943577202142]


def test_block_size_one() -> None:
    # 1.6.1 select, block 1.
    blocks = block_hashes([0, 1, 65535, 65536, 4294967294], 1)
    assert sequence_hashes(blocks) == [
        16451421758532862321,
        5478772005252122579,
        5901914752645013109,
        2340433601102485835,
        18109084259685940558,
    ]


def test_multimodal_hashes_are_sorted_and_appended() -> None:
    # 1.6.1 select: mm_routing_info.block_mm_infos with mm_hash [9, 3, 2**64-1] on block 0 and [42] on block 2.
    tokens = list(range(100, 112))
    mm = [[9, 3, 18446744073709551615], None, [42]]
    expected_seq = [3632647635666220320, 12546717654588087609, 6678347744738315817]
    assert sequence_hashes(block_hashes(tokens, 4, mm_hashes_per_block=mm)) == expected_seq
    shuffled = [[18446744073709551615, 9, 3], [], [42]]  # order and empty lists do not matter
    assert sequence_hashes(block_hashes(tokens, 4, mm_hashes_per_block=shuffled)) == expected_seq
    assert block_hashes(tokens, 4, mm_hashes_per_block=[None, None, None]) == block_hashes(tokens, 4)


def test_eagle_windows_overlap_by_one_token() -> None:
    # 1.6.1 select with is_eagle: windows of block_size + 1 tokens, stride block_size.
    eagle_seq = [1914873892905420881, 13136491855314414045, 14998081555153400732, 5307840938690206185]
    assert sequence_hashes(block_hashes(list(range(1, 18)), 4, eagle=True)) == eagle_seq
    assert sequence_hashes(block_hashes(list(range(1, 17)), 4, eagle=True)) == eagle_seq[:3]
    assert block_hashes(list(range(1, 5)), 4, eagle=True) == []
    assert len(block_hashes(list(range(1, 6)), 4, eagle=True)) == 1
    assert sequence_hashes(block_hashes(list(range(1, 10)), 4, eagle=True, lora_name="alpha")) == [
        5254433303129818259,
        16070678952714769838,
    ]


def test_sequence_hashes_accept_signed_input() -> None:
    signed = [to_i64(h) for h in BLOCKS_1_16]
    assert any(h < 0 for h in signed)
    assert sequence_hashes(signed) == SEQ_1_16
    assert sequence_hashes([]) == []


def test_next_sequence_hash_extends_a_chain() -> None:
    assert next_sequence_hash(SEQ_1_16[1], BLOCKS_1_16[2]) == SEQ_1_16[2]


@pytest.mark.parametrize("tokens", [[-1, 2, 3, 4], [2**32, 0, 0, 0], [1.0, 2, 3, 4], [[1, 2], 3, 4, 5]])
def test_tokens_outside_u32_are_rejected(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(tokens, 4)  # type: ignore[arg-type]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
def test_blocks_are_independent_of_what_follows(tokens: list[int], block_size: int) -> None:
    """A block's hash depends only on its own tokens, so prefixes of a prompt hash as prefixes."""
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    assert all(0 <= h <= U64_MASK for h in full)
    for k in range(len(full) + 1):
        assert block_hashes(tokens[: k * block_size], block_size) == full[:k]
    seq = sequence_hashes(full)
    assert len(seq) == len(full)
    assert all(to_u64(h) == h for h in seq)
    if full:
        assert seq[0] == full[0]
