"""The frontend's settings and its bounds, each with a name and an overflow policy.

| bound | default | past it |
|---|---|---|
| ``max_in_flight`` requests proxied at once | 1,024 | reject newest: 503 with ``Retry-After: 1`` |
| ``body_limit`` bytes of a client's body | 8 MiB | 413 |
| ``body_timeout`` for that body to arrive | 30 s | 408 |
| ``max_prompt_chars`` of a prompt, before tokenizing: ``max_prompt_tokens`` x 16 | 16,777,216 | 400 |
| ``tokenize_queue_chars`` of prompts waiting for or in a tokenizer thread | 16,777,216 | reject newest: 503 |
| ``tokenizer_threads`` tokenizing at once | 2 | the next prompt waits (within the queue bound) |
| ``max_prompt_tokens`` after tokenizing | 1,048,576 | 400 |
| ``connect_timeout`` to reach a worker | 5 s | another worker once, then 503 |
| ``read_timeout``: a worker silent that long | 120 s | 504 (or the stream ends with an error event) |
| ``request_timeout``: a whole proxied request | 600 s | 504 (or the stream ends with an error event) |
| ``error_body_limit``: a worker's error answer read | 64 KiB | the rest is not read |
| ``sse_scan_limit``: bytes scanned for the first token | 1 MiB | counted as the first token |
| ``breaker_cool_down``: a failed worker out of selection before its first trial | 1 s | probed (``/health``) |
| ``breaker_max_cool_down``: the cap of the doubling cool-down after failed trials | 30 s | probed again |

Circuit breakers are kept per worker endpoint in the catalog, at most one probe each in flight
(``docs/frontend.md#dead-workers``).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from kvrouter.actors.core.breakers import COOL_DOWN_SECONDS, MAX_COOL_DOWN_SECONDS
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.api.http.auth import BearerToken
from kvrouter.api.http.server import HttpSettings
from kvrouter.journal.store import Durability

DEFAULT_PORT = 8000  # the seed's frontend port
ROUTER_MODES = ("kv", "round-robin", "random", "kv-ttft")  # the seed's --router-mode choices, and kv-ttft
# The most characters a prompt may have per token of --max-prompt-tokens, checked before tokenizing. Real text
# averages 3 to 5 characters per token with a model's tokenizer; 16 refuses nothing a tokenizer would pass
# except prompts made of unusually long tokens.
PROMPT_CHARS_PER_TOKEN = 16


@attrs.frozen
class FrontendLimits:
    max_in_flight: int = 1024
    body_limit: int = 8 * 1024 * 1024
    body_timeout: float = 30.0
    max_prompt_tokens: int = 1 << 20
    tokenizer_threads: int = 2
    tokenize_queue_chars: int = 16 * 1024 * 1024
    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    request_timeout: float = 600.0
    error_body_limit: int = 64 * 1024
    sse_scan_limit: int = 1024 * 1024
    breaker_cool_down: float = COOL_DOWN_SECONDS
    breaker_max_cool_down: float = MAX_COOL_DOWN_SECONDS

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * PROMPT_CHARS_PER_TOKEN


@attrs.frozen
class WorkerSpec:
    """A worker named by ``--workers``: its HTTP endpoint and, when known, its KV-events endpoint."""

    endpoint: str
    kv_events_endpoint: str | None = None


@attrs.frozen
class FrontendOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_dir: Path | None = None  # None: the journal lives in memory (tests, the demo)
    durability: Durability = Durability.ALWAYS
    fresh: bool = False
    router: RouterConfig = attrs.Factory(RouterConfig)
    workers: tuple[WorkerSpec, ...] = ()
    model_name: str = "mock"  # the model of the --workers
    block_size: int = 16  # the block size of the --workers
    tokenizer: Path | None = None  # None: the built-in tokenizer
    model_path: Path | None = None  # a model directory: its tokenizer and chat template (docs/tokenizing.md)
    limits: FrontendLimits = attrs.Factory(FrontendLimits)
    http: HttpSettings = attrs.Factory(HttpSettings)
    auth: BearerToken | None = None
    seed: int | None = None
    fleet: FleetOptions = attrs.Factory(FleetOptions)  # discovery and Dynamo's event plane (docs/fleet.md)
    selection_urls: tuple[str, ...] = ()  # a selection service (or its cluster's replicas) to call over HTTP
