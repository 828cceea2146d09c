"""Hypercorn embedded in our own nursery (trio worker), configured for a JSON API service."""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve


def hypercorn_config(host: str, port: int) -> Config:
    config = Config()
    bind_host = f"[{host}]" if ":" in host else host
    config.bind = [f"{bind_host}:{port}"]
    config.accesslog = None  # the access log costs ~25% of throughput; off by default
    # Through our logging setup (one line per message, our format and level), not a second handler.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_max_requests = 1 << 62  # never recycle healthy keep-alive connections
    config.graceful_timeout = 3.0
    config.websocket_ping_interval = None
    config.websocket_max_message_size = 1 << 20
    return config


async def serve_http(
    app: Any,
    config: Config,
    shutdown_trigger: Any,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
