"""What marks a forwarded batch while it runs on the owner, apart from the cluster's modules (the ``POST /batch``
route of every service reads it, and a single node should not load the forwarder's HTTP client for that)."""

from __future__ import annotations

import contextvars
from typing import Final

# Set while a ``POST /batch`` that another replica forwarded runs here: its commands are never forwarded again.
FORWARDED_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("forwarded_batch", default=False)
# The largest answer a replica takes back from an owner (``Forwarder``); a forwarded batch may answer that much.
FORWARDED_ANSWER_BYTES: Final = 64 * 1024 * 1024
