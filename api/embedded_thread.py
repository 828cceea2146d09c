"""The in-process router for asyncio code and plain threads: one trio loop on a thread of its own.

``Router.open`` runs inside ``trio.run`` on a dedicated thread (``client/loop_thread.py``, the bridge the
threaded clients use too), and calls are carried into it: each becomes a task of that loop, whose outcome comes
back through an asyncio future (``AsyncioRouter``, for asyncio loops such as Ray Serve's) or a
``concurrent.futures.Future`` (``BlockingRouter``, for any thread). The router's actors, journal and KV listeners
never leave that loop, so there is no locking anywhere.

Both faces have exactly ``Router``'s methods (``ROUTER_METHODS``: the operations the table gives an embedded
name, plus ``apply_kv_events``), generated from them with the same signatures and documentation.

Closing stops taking calls, lets the ones in flight finish, closes the router (actors, journal flushed and
closed, listeners) and joins the thread. A call cancelled on the asyncio side cancels its task in the loop;
like an HTTP request whose client went away, a booking it had already made stays made.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from kvrouter.api.embedded import Router, RouterClosed
from kvrouter.client.loop_thread import LoopThread
from kvrouter.client.table import OPERATIONS

# What the faces offer: every operation with an embedded name (Dynamo's KvPushRouter names), and KV events given
# in-process (a service hears them over ZMQ instead).
ROUTER_METHODS = tuple(sorted({op.embedded for op in OPERATIONS if op.embedded is not None} | {"apply_kv_events"}))


def _closed(why: str) -> RouterClosed:
    return RouterClosed() if why == "closed" else RouterClosed(f"the router {why}")


def _start(model_name: str, options: dict[str, Any]) -> LoopThread[Router]:
    """Start the thread and wait until the router is open (the journal recovered); a failure to open (a data
    directory in use, a corrupt journal, an unknown option) is raised here."""
    return LoopThread(
        lambda: Router.open(model_name, **options),
        name=f"kvrouter-router {model_name}",
        closed_error=_closed,
        finish_on_close=True,
    )


def _blocking(name: str) -> Callable[..., Any]:
    method = getattr(Router, name)

    @functools.wraps(method)
    def call(self: BlockingRouter, *args: Any, **kwargs: Any) -> Any:
        return self._host.call_blocking(lambda: getattr(self._host.resource, name)(*args, **kwargs))

    return call


def _awaitable(name: str) -> Callable[..., Any]:
    method = getattr(Router, name)

    @functools.wraps(method)
    async def call(self: AsyncioRouter, *args: Any, **kwargs: Any) -> Any:
        return await self._host.call(lambda: getattr(self._host.resource, name)(*args, **kwargs))

    return call


class BlockingRouter:
    """The in-process router for plain threads: the methods of ``Router``, blocking until they are done.

    ``BlockingRouter(model_name, **options)`` takes ``Router.open``'s options and starts the router on a
    thread of its own; any thread may call it, concurrently. Close it with ``close()`` or a ``with`` block.
    """

    def __init__(self, model_name: str = "default", **options: Any) -> None:
        self._host = _start(model_name, options)
        self.scope = self._host.resource.scope

    def __enter__(self) -> BlockingRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop taking calls, let those in flight finish, close the router and join its thread (raises what
        stopped the router, if something did). Idempotent."""
        self._host.close()

    def __getattr__(self, name: str) -> Any:  # for type checkers: the generated methods below
        raise AttributeError(name)


class AsyncioRouter:
    """The in-process router for asyncio code (Ray Serve deployments included): ``Router``'s methods as
    coroutines of the running asyncio loop.

    ``AsyncioRouter(model_name, **options)`` takes ``Router.open``'s options and starts the router on a
    thread of its own, waiting until it is open (fine in a deployment's ``__init__``); ``await
    AsyncioRouter.start(...)`` does the same without holding up the asyncio loop. Close it with
    ``await router.aclose()`` or an ``async with`` block.
    """

    def __init__(self, model_name: str = "default", **options: Any) -> None:
        self._host = _start(model_name, options)
        self.scope = self._host.resource.scope

    @classmethod
    async def start(cls, model_name: str = "default", **options: Any) -> AsyncioRouter:
        return await asyncio.to_thread(lambda: cls(model_name, **options))

    async def __aenter__(self) -> AsyncioRouter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.to_thread(self._host.close)

    def close(self) -> None:
        """``aclose`` for code outside the asyncio loop (it blocks until the router has closed)."""
        self._host.close()

    def __getattr__(self, name: str) -> Any:  # for type checkers: the generated methods below
        raise AttributeError(name)


for _name in ROUTER_METHODS:
    setattr(BlockingRouter, _name, _blocking(_name))
    setattr(AsyncioRouter, _name, _awaitable(_name))
del _name
