"""Built-in synthetic workloads, as traces (``--synthetic NAME[:key=value,...]``).

Prompts are chains of trace blocks (``hash_ids``, ``block_size`` tokens each, 512 by default) so they
run through the same path as a Mooncake trace. Arrivals are Poisson; every draw comes from
``Random(f"{seed}:synthetic:{name}")``. Parameters (defaults in brackets):

``shared-prefix`` -- requests that start with one of a few system prompts.
    requests [1000], prompts [8] distinct system prompts, prefix_blocks [8] blocks each, unique_blocks [2]
    blocks of user text per request, rate [10] requests/s, output [128] mean output tokens (exponential).
``chat`` -- multi-turn sessions: each turn resends the conversation so far plus a new message.
    sessions [200], turns [4], first_blocks [4] blocks in the first message, turn_blocks [1] new blocks per
    turn (the previous answer and the new message), think_s [5] mean seconds between turns, rate [2] new
    sessions/s, output [128] mean output tokens.
``agentic`` -- tool loops: a long shared preamble (tool definitions), then step after step each adding a
    tool result. agents [50], steps [8], system_blocks [16] shared blocks, tool_blocks [2] blocks per step,
    step_gap_s [1] mean seconds between steps, rate [1] new agents/s, output [64] mean output tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvrouter.simulations.trace import MOONCAKE_BLOCK_SIZE, Trace, TraceError, from_rows

Row = tuple[float, int, int, list[int]]

DEFAULTS: dict[str, dict[str, float]] = {
    "shared-prefix": {
        "requests": 1000,
        "prompts": 8,
        "prefix_blocks": 8,
        "unique_blocks": 2,
        "rate": 10.0,
        "output": 128,
    },
    "chat": {
        "sessions": 200,
        "turns": 4,
        "first_blocks": 4,
        "turn_blocks": 1,
        "think_s": 5.0,
        "rate": 2.0,
        "output": 128,
    },
    "agentic": {
        "agents": 50,
        "steps": 8,
        "system_blocks": 16,
        "tool_blocks": 2,
        "step_gap_s": 1.0,
        "rate": 1.0,
        "output": 64,
    },
}


class _Ids:
    """Fresh block ids (distinct content)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> list[int]:
        start = self.next
        self.next += count
        return list(range(start, start + count))


def _output(rng: random.Random, mean: float) -> int:
    return max(1, round(rng.expovariate(1 / mean))) if mean > 0 else 1


def _length(rng: random.Random, blocks: int, block_size: int) -> int:
    """A prompt filling ``blocks`` blocks, the last one partly (as real prompts do)."""
    return (blocks - 1) * block_size + rng.randint(1, block_size)


def shared_prefix(rng: random.Random, p: dict[str, float], bs: int) -> list[Row]:
    ids = _Ids()
    prompts = [ids.take(int(p["prefix_blocks"])) for _ in range(int(p["prompts"]))]
    rows, at = [], 0.0
    for _ in range(int(p["requests"])):
        at += rng.expovariate(p["rate"]) * 1000.0
        chain = rng.choice(prompts) + ids.take(int(p["unique_blocks"]))
        rows.append((at, _length(rng, len(chain), bs), _output(rng, p["output"]), chain))
    return rows


def chat(rng: random.Random, p: dict[str, float], bs: int) -> list[Row]:
    ids = _Ids()
    rows, start = [], 0.0
    for _ in range(int(p["sessions"])):
        start += rng.expovariate(p["rate"]) * 1000.0
        chain = ids.take(int(p["first_blocks"]))
        at = start
        for _ in range(int(p["turns"])):
            rows.append((at, _length(rng, len(chain), bs), _output(rng, p["output"]), list(chain)))
            chain = chain + ids.take(int(p["turn_blocks"]))
            at += rng.expovariate(1 / p["think_s"]) * 1000.0 if p["think_s"] > 0 else 0.0
    return rows


def agentic(rng: random.Random, p: dict[str, float], bs: int) -> list[Row]:
    ids = _Ids()
    system = ids.take(int(p["system_blocks"]))
    rows, start = [], 0.0
    for _ in range(int(p["agents"])):
        start += rng.expovariate(p["rate"]) * 1000.0
        chain = system + ids.take(1)  # the task
        at = start
        for _ in range(int(p["steps"])):
            rows.append((at, _length(rng, len(chain), bs), _output(rng, p["output"]), list(chain)))
            chain = chain + ids.take(int(p["tool_blocks"]))
            at += rng.expovariate(1 / p["step_gap_s"]) * 1000.0 if p["step_gap_s"] > 0 else 0.0
    return rows


GENERATORS: dict[str, Callable[[random.Random, dict[str, float], int], list[Row]]] = {
    "shared-prefix": shared_prefix,
    "chat": chat,
    "agentic": agentic,
}


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME[:key=value,...]`` -> (name, parameters with defaults filled in)."""
    name, _, rest = spec.partition(":")
    if name not in GENERATORS:
        raise TraceError(f"unknown synthetic workload {name!r} (choose from {', '.join(GENERATORS)})")
    params = dict(DEFAULTS[name])
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in params:
            raise TraceError(f"--synthetic {name}: unknown parameter {key!r} (known: {', '.join(params)})")
        try:
            number = float(value)
        except ValueError:
            raise TraceError(f"--synthetic {name}: {key}={value!r} is not a number") from None
        if not number >= 0 or number == float("inf"):
            raise TraceError(f"--synthetic {name}: {key} must be a finite number >= 0, got {value}")
        params[key] = number
    for key in ("rate",):
        if params[key] <= 0:
            raise TraceError(f"--synthetic {name}: {key} must be positive")
    return name, params


def synthetic(spec: str, seed: int, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    name, params = parse_spec(spec)
    rng = random.Random(f"{seed}:synthetic:{name}")
    rows = GENERATORS[name](rng, params, block_size)
    if not rows:
        raise TraceError(f"--synthetic {spec}: the parameters give no requests")
    return from_rows(rows, block_size, f"synthetic:{spec}")
