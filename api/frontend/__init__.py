"""``kvrouter frontend``: an OpenAI-compatible proxy that routes each request with the selection service's core.

The loop of the seed's ``python -m dynamo.frontend --router-mode kv``: tokenize, select and book a worker rank
through the scope actor in-process (journaled), forward to the worker with streaming passthrough, mark prefill
complete at the first streamed token, free at the end. The selection service's own routes (``POST /workers``,
``/loads``, ...) are served on the same port.
"""
