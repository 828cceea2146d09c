"""``kvrouter mock-worker``: an OpenAI-compatible inference worker without a GPU.

The simulator's engine model (``kvrouter.simulations.engine``: KV cache with LRU and prefix caching,
chunked prefill, a batch limit, the ``dynamo-mocker`` timing) runs on the real clock scaled by
``--speedup``; its KV events go out over ZMQ in vLLM's wire format, with a replay endpoint; it can
register itself with a selection service. Modules: ``tokenizer`` (the built-in tokenizer), ``engine_loop``
(the real-time driver), ``kv_publisher`` (ZMQ PUB + replay ROUTER), ``openai_app`` (the HTTP routes),
``registration``, ``service`` (composition) and ``cli``.
"""
