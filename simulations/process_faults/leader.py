"""After healing: when the journal's stream has a leader again. A stream's info is answered by its leader only, so
the first answer marks it. The NATS nodes elect a new leader after losing one on their own schedule (nats-server's
Raft waits several seconds before an election), so the replicas' agreement is timed from then, not from the last
fault alone: the stream's own failover is not the replicas' to shorten."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import trio

from kvrouter.journal.jetstream_link import open_nats

ASK_SECONDS = 1.0  # each ask's timeout; asked again at once after one without an answer


async def _ask_until_led(servers: tuple[str, ...], stream: str, seconds: float) -> bool:
    nc = await open_nats(servers, "process-faults-leader")
    try:
        js = nc.jetstream(timeout=ASK_SECONDS)
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            try:
                await js.stream_info(stream)
                return True
            except (TimeoutError, nats.errors.Error):
                await asyncio.sleep(0.1)
        return False
    finally:
        await nc.close()


async def stream_led(servers: tuple[str, ...], stream: str, seconds: float) -> bool:
    """Whether ``stream`` answered its info (so had a leader) within ``seconds``."""

    def ask() -> bool:
        try:
            return asyncio.run(_ask_until_led(servers, stream, seconds))
        except (OSError, TimeoutError, nats.errors.Error):
            return False

    return await trio.to_thread.run_sync(ask)
