"""Traces: Mooncake loading, the block-size mapping, speedup, synthetic workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter.actors.core.hashing import block_hashes, sequence_hashes
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.prompts import PromptHasher
from kvrouter.simulations.trace import TraceError, TraceRequest, load_mooncake

SHIPPED = next(
    (
        found
        for parent in Path(__file__).resolve().parents
        if (found := parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl").exists()
    ),
    Path("mooncake_synthetic_trace.jsonl"),
)


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_rows_are_read_sorted_by_arrival(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"timestamp": 40, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}',
        "",
        '{"timestamp": 0, "input_length": 2000, "output_length": 0, "hash_ids": [7]}',
    )
    trace = load_mooncake(path)
    assert [r.arrival_ms for r in trace.requests] == [0.0, 40.0]
    assert [r.index for r in trace.requests] == [0, 1]
    first = trace.requests[0]
    assert first.input_length == 512  # cut to what its hash ids can describe
    assert first.output_length == 1  # a request yields at least one token
    assert trace.sped_up(4).requests[1].arrival_ms == 10.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "trace.jsonl:2: not JSON"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "trace.jsonl:2: missing hash_ids"),
        ('{"input_length": -1, "output_length": 1, "hash_ids": [1]}', "input_length must be a non-negative integer"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "hash_ids must be a non-empty list"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp must be"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}', line)
    with pytest.raises(TraceError, match=message):
        load_mooncake(path)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_mooncake(tmp_path / "absent.jsonl")


def test_tokens_repeat_each_hash_id_over_its_trace_block() -> None:
    request = TraceRequest(0, 0.0, 10, 1, (5, 9, 11))
    assert request.token_ids(4) == [5, 5, 5, 5, 9, 9, 9, 9, 11, 11]


@pytest.mark.parametrize(("trace_bs", "engine_bs"), [(512, 64), (8, 4), (6, 4), (4, 16)])
def test_prompt_hashes_are_the_routers_hashes_of_the_tokens(trace_bs: int, engine_bs: int) -> None:
    request = TraceRequest(0, 0.0, 3 * trace_bs - 1, 1, (3, 4, 70000))
    blocks = PromptHasher(trace_bs, engine_bs).blocks(request)
    expected = block_hashes(request.token_ids(trace_bs), engine_bs)
    assert list(blocks.local_hashes) == expected
    assert list(blocks.sequence_hashes) == sequence_hashes(expected)


def test_requests_sharing_trace_blocks_share_engine_blocks() -> None:
    hasher = PromptHasher(512, 64)
    a = hasher.blocks(TraceRequest(0, 0.0, 1024, 1, (1, 2)))
    b = hasher.blocks(TraceRequest(1, 0.0, 1024, 1, (1, 3)))
    assert a.sequence_hashes[:8] == b.sequence_hashes[:8]
    assert not set(a.sequence_hashes[8:]) & set(b.sequence_hashes[8:])


@pytest.mark.skipif(not SHIPPED.exists(), reason="the shipped trace is not beside the repository")
def test_the_shipped_trace_loads() -> None:
    trace = load_mooncake(SHIPPED)
    assert len(trace.requests) == 3993 and trace.block_size == 512


@pytest.mark.parametrize("spec", ["shared-prefix:requests=50", "chat:sessions=10,turns=3", "agentic:agents=5"])
def test_synthetic_workloads_are_seeded(spec: str) -> None:
    first, again, other = synthetic(spec, 1), synthetic(spec, 1), synthetic(spec, 2)
    assert first == again and first != other
    assert all(r.input_length <= len(r.hash_ids) * first.block_size for r in first.requests)


def test_chat_turns_extend_the_previous_prompt() -> None:
    trace = synthetic("chat:sessions=1,turns=3,think_s=1", 0)
    chains = [r.hash_ids for r in trace.requests]
    assert chains[1][: len(chains[0])] == chains[0] and chains[2][: len(chains[1])] == chains[1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [("nope", "unknown synthetic workload"), ("chat:colour=3", "unknown parameter"), ("chat:rate=0", "positive")],
)
def test_bad_synthetic_specs_are_named(spec: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        synthetic(spec, 0)
