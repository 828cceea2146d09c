"""Run a kvrouter service with a record of what held its event loop, for ``select_flood_bench.py --breakdown``.

    python benchmarks/loop_trace.py OUT.json -m kvrouter.api.select_service [service arguments]

Trio runs one task step at a time, so a request that waited did so behind steps of other tasks (or a cyclic GC
pass inside one). Recorded, in the service's own process: every task step longer than ``STEP_FLOOR`` (its start on
``time.perf_counter``, which is CLOCK_MONOTONIC and so comparable with the client's; its wall and thread CPU time;
the task's name; GC time inside it) and every GC pass (start, duration, generation). Written to OUT.json when the
service's ``trio.run`` returns (a SIGTERM stops it gracefully). At most ``MAX_RECORDS`` of each are kept (later ones
are counted, not kept): memory stays bounded whatever the run's length. The instrument costs two clock reads per
step, so measure latency without it; the breakdown says what the tail is made of, not how long it is.
"""

from __future__ import annotations

import gc
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import trio

STEP_FLOOR = 0.0003  # seconds: shorter steps are a request's own work or scheduling noise
MAX_RECORDS = 500_000


class LoopRecorder(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, str, float]] = []  # start, wall, cpu, task name, gc inside
        self.gcs: list[tuple[float, float, int]] = []  # start, duration, generation
        self.dropped = 0
        self._started = self._cpu = self._gc_started = self._gc_in_step = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._gc_in_step = 0.0
        self._cpu = time.thread_time()
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        wall = time.perf_counter() - self._started
        if wall > STEP_FLOOR:
            if len(self.steps) < MAX_RECORDS:
                cpu = time.thread_time() - self._cpu
                self.steps.append((self._started, wall, cpu, task.name, self._gc_in_step))
            else:
                self.dropped += 1

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        self._gc_in_step += took
        if len(self.gcs) < MAX_RECORDS:
            self.gcs.append((self._gc_started, took, info["generation"]))
        else:
            self.dropped += 1

    def write(self, path: Path) -> None:
        record = {"steps": self.steps, "gcs": self.gcs, "dropped": self.dropped, "gc_threshold": gc.get_threshold()}
        path.write_text(json.dumps(record))


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit("usage: loop_trace.py OUT.json -m MODULE [arguments]")
    out, module = Path(sys.argv[1]), sys.argv[3]
    recorder = LoopRecorder()
    real_run = trio.run

    def traced_run(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), recorder]
        try:
            return real_run(*args, **kwargs)
        finally:
            recorder.write(out)

    trio.run = traced_run  # the service's CLI calls trio.run once, for the process's whole life
    gc.callbacks.append(recorder.on_gc)
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
