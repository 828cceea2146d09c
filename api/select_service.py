"""``python -m api.select_service`` mirrors the reference's ``python -m dynamo.select_service``.

Also the composition of the selection service: index recovery from ``--indexer-peers``, the KV
ingest (one listener per worker rank) and the route table, started inside ``api.main.run_service``.
"""

from __future__ import annotations

import logging
import sys
import urllib.request
from collections.abc import Sequence
from functools import partial
from typing import Any

import orjson
import trio

from kvrouter.actors.core.commands import RecoverKv
from kvrouter.actors.core.dump import DumpError, parse_dump
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.system import ActorSystem
from kvrouter.api.http import Route
from kvrouter.api.main import RouteBuilder, ServiceOptions, start_replication_for
from kvrouter.api.select_routes import select_service_routes

log = logging.getLogger("kvrouter.select_service")

PEER_TIMEOUT_SECONDS = 10.0


def fetch_dump(url: str) -> Any:
    with urllib.request.urlopen(url.rstrip("/") + "/dump", timeout=PEER_TIMEOUT_SECONDS) as response:
        return orjson.loads(response.read())


async def recover_from_peers(system: ActorSystem, peers: Sequence[str]) -> str | None:
    """Seed the index from the first peer whose ``/dump`` answers (a kvrouter or reference selector
    or indexer); returns that peer's URL. Runs before the HTTP listener opens."""
    for url in peers:
        try:
            document = await trio.to_thread.run_sync(fetch_dump, url)
            scopes = parse_dump(document)
        except (OSError, ValueError, DumpError) as exc:
            log.warning("indexer peer %s unusable: %s", url, exc)
            continue
        blocks = 0
        for scope, (_, runs) in sorted(scopes.items()):
            if runs:
                await system.ask(scope, RecoverKv(tuple(runs), at=system.clock.now_ns()))
                blocks += sum(len(run.blocks) for run in runs)
        log.info("recovered %d blocks in %d scopes from indexer peer %s", blocks, len(scopes), url)
        return url
    if peers:
        log.warning("no indexer peer answered; starting with the local index only")
    return None


async def select_service_app(
    config: RouterConfig, peers: Sequence[str], options: ServiceOptions, system: ActorSystem, nursery: trio.Nursery
) -> list[Route]:
    await recover_from_peers(system, peers)
    ingest: KvIngest = await nursery.start(KvIngest(system).run)
    replication = await start_replication_for(options, system, nursery)
    return select_service_routes(system, ingest, config) + replication


def builder(config: RouterConfig, indexer_peers: Sequence[str] = ()) -> RouteBuilder:
    return partial(select_service_app, config, tuple(indexer_peers))


if __name__ == "__main__":
    from kvrouter.api.cli import main

    sys.exit(main(["select-service", *sys.argv[1:]]))
