"""kvrouter's client: the command stream (``GET /ws/commands``) from trio, asyncio or plain threads.

    from kvrouter.client import StreamClient      # trio: async with StreamClient.connect(url) as client
    from kvrouter.client import AsyncioClient     # asyncio: await client.add(...)
    from kvrouter.client import BlockingClient    # threads: client.add(...)
    from kvrouter.client import ReplicaClient     # trio, a cluster's replicas: ReplicaClient.connect([url, ...])

Every flavour has the same operations (``kvrouter.client.operations.Operations``); a refused command
raises ``CommandError`` with the service's status and message. See the README's "Batches, the command
stream and the client library".
"""

from kvrouter.client.operations import Booking, CommandError, Reply, Selection, StreamClosed
from kvrouter.client.replicas import NoReplica, OutcomeUnknown, ReplicaClient
from kvrouter.client.stream import StreamClient
from kvrouter.client.threaded import AsyncioClient, BlockingClient

__all__ = [
    "AsyncioClient",
    "BlockingClient",
    "Booking",
    "CommandError",
    "NoReplica",
    "OutcomeUnknown",
    "ReplicaClient",
    "Reply",
    "Selection",
    "StreamClient",
    "StreamClosed",
]
