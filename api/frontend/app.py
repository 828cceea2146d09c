"""The frontend's ASGI app: the OpenAI routes (streamed by ``Proxy``) in front of the selection service's app.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /frontend/stats`` are
answered here; every other request goes to the selection service's own app (``kvrouter.api.http.app.make_app``:
``POST /workers``, ``/loads``, ``/health``, ...), so workers register on the port clients use. The bearer token,
when set, guards the OpenAI routes as it guards the service's.
"""

from __future__ import annotations

import time
from typing import Any

from kvrouter.api.frontend.proxy import Proxy, send_response
from kvrouter.api.http import error_response, json_response
from kvrouter.api.http.auth import BearerToken
from kvrouter.client.table import OPENAI, served_by

ASGIScope = dict[str, Any]
# The operation table's OpenAI operations (client/table.py): path -> the one method it answers, and their paths.
OWN_ROUTES = {op.path: op.method for op in served_by(OPENAI)}
PATHS = {op.name: op.path for op in served_by(OPENAI)}
CHAT, MODELS, STATS = PATHS["chat_completions"], PATHS["models"], PATHS["frontend_stats"]


class FrontendApp:
    def __init__(self, proxy: Proxy, service_app: Any, auth: BearerToken | None = None) -> None:
        self.proxy = proxy
        self.service_app = service_app
        self.auth = auth
        self.created = int(time.time())

    async def __call__(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        method = OWN_ROUTES.get(path) if path is not None else None
        if method is None:
            await self.service_app(scope, receive, send)
            return
        has_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])
        if self.auth is not None:
            authorization = [value for name, value in scope["headers"] if name == b"authorization"]
            if not self.auth.admits(authorization[0] if len(authorization) == 1 else None):
                refusal = self.auth.refusal(authorization[0] if authorization else None)
                await send_response(send, refusal, body_unread=has_body)
                return
        if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
            allow = "GET,HEAD" if method == "GET" else method
            response = error_response(405, "method not allowed", ((b"allow", allow.encode()),))
            await send_response(send, response, body_unread=has_body)
            return
        if path == MODELS:
            await send_response(send, json_response(200, self.models()), head=scope["method"] == "HEAD")
        elif path == STATS:
            await send_response(send, json_response(200, self.proxy.stats()), head=scope["method"] == "HEAD")
        else:
            await self.proxy.handle(scope, receive, send, chat=path == CHAT)

    def models(self) -> dict[str, Any]:
        data = [
            {"id": model, "object": "model", "created": self.created, "owned_by": "kvrouter"}
            for model in self.proxy.routing.models()
        ]
        return {"object": "list", "data": data}
