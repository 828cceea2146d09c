"""When a worker's KV events reach the router: at the end of the forward pass that made them (vLLM's
scheduler takes them after the pass), so a request arriving mid-pass is routed without them."""

from __future__ import annotations

from kvrouter.simulations.cluster import ClusterOptions, simulate_policy
from kvrouter.simulations.timing import EngineParams
from kvrouter.simulations.trace import Trace, TraceRequest

PROMPT = (1, 2, 3, 4)  # four 512-token trace blocks: a 2,048-token prompt, one pass of ~50 ms


def test_blocks_a_pass_is_computing_are_invisible_to_the_router_until_it_ends() -> None:
    trace = Trace(
        (
            TraceRequest(0, 0.0, 2048, 2, PROMPT),
            TraceRequest(1, 10.0, 2048, 2, PROMPT),  # arrives while the first request's prefill runs
            TraceRequest(2, 1_000.0, 2048, 2, PROMPT),  # long after it
        )
    )
    run = simulate_policy(trace, ClusterOptions(workers=2, seed=1, engine=EngineParams(num_blocks=1_024)))
    first, mid_pass, later = run.records
    assert first.first_token_ms is not None and first.first_token_ms > mid_pass.arrival_ms  # really mid-pass
    assert mid_pass.predicted_tokens == 0
    assert later.predicted_tokens == 2048 and later.rank == first.rank
    assert run.failures == []
