"""``python -m simulations --seed S --steps N``: a deterministic run of the slot tracker actors.

Prints the seed and options first (a failing seed replays exactly), then the journal and state
digests; exits 1 if any invariant or replay check failed.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import trio
import trio.testing

from kvrouter.simulations.harness import SimulationOptions, simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--crash-probability", type=float, default=0.002)
    args = parser.parse_args(argv)
    options = SimulationOptions(steps=args.steps, crash_probability=args.crash_probability)
    print(f"seed={args.seed} options={options}", flush=True)
    clock = trio.testing.MockClock(autojump_threshold=0)
    result = trio.run(partial(simulate, args.seed, options), clock=clock)
    print(
        f"steps={result.steps} accepted={result.accepted} rejected={result.rejected} "
        f"crashes={result.crashes} snapshots={result.snapshots} journal_records={result.journal_records}"
    )
    print(f"journal_digest={result.journal_digest}")
    print(f"state_digest={result.state_digest}")
    for failure in result.failures:
        print(f"FAILED: {failure}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
