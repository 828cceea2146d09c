"""The command routes every service serves next to its own: ``POST /batch`` and the command stream."""

from __future__ import annotations

from kvrouter.api.command_stream import stream_route
from kvrouter.api.commands import CommandRunner, batch_route
from kvrouter.api.http import Route


def with_command_routes(routes: list[Route]) -> list[Route]:
    """``routes`` plus ``POST /batch`` and ``GET /ws/commands``, whose commands are dispatched through a
    table of all of them (the same ``Route`` objects the app serves)."""
    runner = CommandRunner()
    served = [*routes, batch_route(runner), stream_route(runner)]
    runner.serve(served)
    return served
