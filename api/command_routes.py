"""The command routes every service serves next to its own: ``POST /batch`` and the command stream."""

from __future__ import annotations

from kvrouter.api.command_stream import stream_route
from kvrouter.api.commands import CommandRunner, batch_route
from kvrouter.api.http import Route
from kvrouter.api.openapi import openapi_route
from kvrouter.api.operation_routes import check_served


def with_command_routes(
    routes: list[Route], service: str, openapi_title: str | None = None, version: str = ""
) -> list[Route]:
    """``routes`` plus ``POST /batch`` and ``GET /ws/commands``, whose commands are dispatched through a
    table of all of them (the same ``Route`` objects the app serves); with ``openapi_title``, also
    ``GET /openapi.json`` describing the whole table, itself included, and resolvable as a command like
    every other route. The result must serve exactly ``service``'s operations (``client/table.py``)."""
    runner = CommandRunner()
    served = [*routes, batch_route(runner), stream_route(runner)]
    if openapi_title is not None:
        served.append(openapi_route(list(served), openapi_title, version))
    check_served(service, served)
    runner.serve(served)
    return served
