"""The command routes every service serves next to its own: ``POST /batch`` and the command stream."""

from __future__ import annotations

from kvrouter.api.http import Route
from kvrouter.api.routes.metrics import FrontMetrics
from kvrouter.api.routes.openapi import openapi_route
from kvrouter.api.routes.operations import check_served
from kvrouter.api.streams.answer_budget import DEFAULT_BUDGETS, AnswerBudgets, AnswerMetrics
from kvrouter.api.streams.command_runner import CommandRunner, batch_route
from kvrouter.api.streams.command_stream import stream_route


def with_command_routes(
    routes: list[Route],
    service: str,
    openapi_title: str | None = None,
    version: str = "",
    *,
    budgets: AnswerBudgets = DEFAULT_BUDGETS,
    front: FrontMetrics | None = None,
) -> list[Route]:
    """``routes`` plus ``POST /batch`` and ``GET /ws/commands``, whose commands are dispatched through a
    table of all of them (the same ``Route`` objects the app serves); with ``openapi_title``, also
    ``GET /openapi.json`` describing the whole table, itself included, and resolvable as a command like
    every other route. The result must serve exactly ``service``'s operations (``client/table.py``).
    ``budgets``: the bounds of their answers (``api/streams/answer_budget.py``), counted in ``front``'s figures."""
    runner = CommandRunner()
    metrics = AnswerMetrics(front.registry if front is not None else None)
    served = [*routes, batch_route(runner, budgets, metrics), stream_route(runner, budgets=budgets, metrics=metrics)]
    if openapi_title is not None:
        served.append(openapi_route(list(served), openapi_title, version))
    check_served(service, served)
    runner.serve(served)
    return served
