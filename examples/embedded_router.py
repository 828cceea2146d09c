"""The router embedded in an asyncio service (a Ray Serve deployment is one): register the engines, feed
the router their KV events, ask it where each request goes and report each request's lifecycle.

    .venv/bin/python examples/embedded_router.py [--data-dir DIR]

With ``--data-dir`` the router keeps its journal there: run it twice and the second run finds the request
the first one left booked. Without it the journal is in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from kvrouter import IN_PROCESS_KV_EVENTS, AsyncioRouter, BlockStored, RouterConfig, RouterError

BLOCK_SIZE = 16


async def main(data_dir: str | None) -> None:
    router = await AsyncioRouter.start("llama", data_dir=data_dir, config=RouterConfig(), seed=1)
    async with router:
        for worker_id in (1, 2):
            # An engine publishing over ZMQ would give kv_events_endpoint="tcp://worker-1:5557" (and its
            # replay_endpoint); the router then subscribes to it exactly as `kvrouter select-service` does.
            # Here the events come from this process, through apply_kv_events.
            await router.register_worker(
                worker_id,
                endpoint=f"http://worker-{worker_id}:8000",
                block_size=BLOCK_SIZE,
                kv_events_endpoint=IN_PROCESS_KV_EVENTS,
            )
        prompt = list(range(1, 65))  # 4 blocks of 16 tokens

        # Worker 2's engine reports the prompt's first three blocks cached (its own block hashes).
        await router.apply_kv_events(2, [BlockStored((1001, 1002, 1003), None, tuple(prompt[:48]), BLOCK_SIZE)])

        worker_id, dp_rank, overlap_blocks = await router.best_worker(prompt)  # a query: books nothing
        print(f"best worker: {worker_id} (dp_rank {dp_rank}), {overlap_blocks} of 4 blocks cached")

        worker_id, dp_rank, _ = await router.best_worker(prompt, request_id="req-1")  # books req-1
        for load in await router.get_potential_loads(prompt):
            print(
                f"worker {load['worker_id']}: {load['active_requests']} active, "
                f"{load['potential_prefill_tokens']} prefill tokens with this prompt"
            )
        # ... send the request to the worker; after its first token:
        await router.mark_prefill_complete("req-1")
        # ... and when it has finished:
        await router.free("req-1")

        try:
            await router.free("req-1")
        except RouterError as error:  # the HTTP API's status and message
            print(f"refused ({error.status}): {error}")

        kept = "req-kept" if data_dir else None
        if kept:
            try:
                await router.free(kept)
                print(f"{kept}: booked by an earlier run, now freed")
            except RouterError:
                await router.best_worker(prompt, request_id=kept)
                print(f"{kept}: booked; run again with the same --data-dir to find it there")

        index = json.loads(await router.dump_events())
        print(f"indexed events: {len(index['llama:default']['events'])}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="keep the router's journal here (default: in memory)")
    asyncio.run(main(parser.parse_args().data_dir))
