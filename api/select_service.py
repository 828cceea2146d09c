"""``python -m api.select_service`` mirrors the reference's ``python -m dynamo.select_service``.

Also the composition of the selection service: the KV ingest (one listener per worker rank) and
the route table, started inside ``api.main.run_service``.
"""

from __future__ import annotations

import sys
from functools import partial

import trio

from actors.core.router_config import RouterConfig
from actors.kv_ingest import KvIngest
from actors.system import ActorSystem
from api.http import Route
from api.select_routes import select_service_routes


async def select_service_app(config: RouterConfig, system: ActorSystem, nursery: trio.Nursery) -> list[Route]:
    ingest: KvIngest = await nursery.start(KvIngest(system).run)
    return select_service_routes(system, ingest, config)


def builder(config: RouterConfig):
    return partial(select_service_app, config)


if __name__ == "__main__":
    from api.cli import main

    sys.exit(main(["select-service", *sys.argv[1:]]))
