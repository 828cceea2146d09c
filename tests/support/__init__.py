"""Test doubles for the processes kvrouter talks to (vLLM/SGLang KV-event publishers, ...)."""
