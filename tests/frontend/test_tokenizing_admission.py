"""Admission to tokenizing (``--max-tokenizing-chars``): long prompts queue for the tokenizer threads only up to a
bound in characters; past it a prompt is refused at once with 503 and ``Retry-After`` (reject newest), and one
prompt alone is always admitted, however long."""

from __future__ import annotations

import threading

import orjson
import pytest
import trio

from kvrouter.api.frontend.options import FrontendLimits
from kvrouter.api.frontend.tokenizing import INLINE_CHARS, Tokenizing
from kvrouter.api.openai.body import Refusal

LONG = "word " * (INLINE_CHARS // 2)  # over INLINE_CHARS: goes to a tokenizer thread


class HeldTokenizer:
    """A thread-run tokenizer (as a Hugging Face one is) that holds each long prompt until released."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, text: str) -> list[int]:
        if len(text) > INLINE_CHARS:
            self.entered.release()
            self.release.wait(10)
        return list(range(len(text.split())))


def body(prompt: str) -> dict[str, object]:
    return {"model": "m", "prompt": prompt, "max_tokens": 1}


async def test_a_prompt_past_the_tokenizing_bound_is_refused_with_503_while_the_first_is_tokenized() -> None:
    tokenizer = HeldTokenizer()
    # Room for one long prompt and not two.
    tokenizing = Tokenizing(tokenizer, FrontendLimits(tokenize_queue_chars=len(LONG) + len(LONG) // 2))
    results: list[int] = []

    async def first() -> None:
        request = await tokenizing.request(body(LONG), chat=False, model="m")
        results.append(len(request.prompt))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.to_thread.run_sync(tokenizer.entered.acquire)  # the first is being tokenized
        assert tokenizing.queued_chars == len(LONG)
        with pytest.raises(Refusal) as refused:
            await tokenizing.request(body(LONG), chat=False, model="m")
        response = refused.value.response
        assert response.status == 503
        assert (b"retry-after", b"1") in response.headers
        assert "--max-tokenizing-chars" in orjson.loads(response.body)["error"]
        # A short prompt is tokenized at once, on the loop: never queued, never refused.
        short = await tokenizing.request(body("a short prompt"), chat=False, model="m")
        assert len(short.prompt) == 3
        tokenizer.release.set()
    assert results == [len(LONG.split())]
    assert tokenizing.queued_chars == 0  # the refused prompt took nothing; the done one gave its share back


async def test_one_prompt_alone_is_admitted_however_long() -> None:
    tokenizer = HeldTokenizer()
    tokenizer.release.set()
    tokenizing = Tokenizing(tokenizer, FrontendLimits(tokenize_queue_chars=10))
    request = await tokenizing.request(body(LONG), chat=False, model="m")
    assert len(request.prompt) == len(LONG.split())
