"""The frontend's prompt checks and tokenizing, kept from holding the event loop.

A prompt is checked in steps, each cheaper than the next:

1. its size in characters (or token ids) against ``max_prompt_chars`` (``--max-prompt-tokens`` times
   ``PROMPT_CHARS_PER_TOKEN``): 400 before any tokenizing;
2. the rest of the body (fields, messages), as the workers check it: 400;
3. admission to tokenizing: at most ``tokenize_queue_chars`` characters of prompts waiting for or being
   tokenized; a prompt that would pass it is refused with 503 and ``Retry-After: 1`` (reject newest; one prompt
   alone is always admitted);
4. the tokenizing, at most ``tokenizer_threads`` prompts at once, then the token count against
   ``--max-prompt-tokens``: 400.

With ``--model-path`` a chat is rendered with the model's template (bounded in bytes as it renders) and tokenized
together, on a worker thread past ``INLINE_CHARS``; a template's refusal is a 400 (``docs/tokenizing.md``).

A Hugging Face tokenizer runs on a worker thread, called so that it releases the GIL while it encodes
(``tokenizers.py``), so the event loop goes on. A text longer than ``--max-prompt-tokens`` characters (one that could
be over the limit) is first counted a slice at a time (``count_over``, slices of ``count_slice_chars`` cut before a
blank, where the models' pre-tokenizers split too): one far over the limit is refused after its first slices instead
of after the whole text is tokenized (seconds for megabytes), and one within it is then tokenized whole, so its ids
are exactly the tokenizer's.
The built-in tokenizer is pure Python and would hold the GIL on a thread (the event loop then waits for it at every
switch), so it runs on the event loop itself a slice of ``SLICE_CHARS`` characters at a time, letting other tasks
run between slices, and stops as soon as the count is over the limit. Short prompts (up to ``INLINE_CHARS``) are
tokenized at once: that takes well under a millisecond, less than the trip to a thread.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from kvrouter.api.frontend.model_dir import ChatRefused, ModelTokenizer
from kvrouter.api.frontend.options import PROMPT_CHARS_PER_TOKEN, FrontendLimits
from kvrouter.api.frontend.tokenizers import Tokenize
from kvrouter.api.http import error_response
from kvrouter.api.openai.body import Refusal, prompt_size
from kvrouter.api.openai.requests import GenerateRequest, RequestProblem, parse_request
from kvrouter.api.openai.tokenizer import SLICE_CHARS, render_chat, slices
from kvrouter.api.openai.tokenizer import tokenize as builtin_tokenize

INLINE_CHARS = 4096
FREE_STEP = 65536  # ids dropped per step when a long prompt is refused (freeing a million ints takes ~30 ms)
COUNT_SLICE_MAX = 256 * 1024  # characters per slice when counting before tokenizing (one call: ~0.2 s at most)
# Tokens a cut between two slices may add to their counts (a normalizer that prepends a word marker to every text, as
# Llama 2's does, adds one): the sum of the slices' counts must pass the limit by this much per cut to refuse.
CUT_SLACK = 4


def _unrendered(messages: list[tuple[str, str]]) -> str:
    return ""


class _Text:
    """Stands in for the tokenizer while the body is checked: keeps the text, answers one placeholder id."""

    def __init__(self) -> None:
        self.text: str | None = None

    def __call__(self, text: str) -> list[int]:
        self.text = text
        return [0]


class Tokenizing:
    """The checked request of a body, its prompt tokenized within the frontend's prompt bounds."""

    def __init__(self, tokenize: Tokenize, limits: FrontendLimits) -> None:
        self.tokenize = tokenize
        self.model = tokenize if isinstance(tokenize, ModelTokenizer) else None  # renders chats with its template
        self.limits = limits
        self.on_loop = tokenize is builtin_tokenize
        self.count: Callable[[str], int] | None = getattr(tokenize, "count", None)  # Hugging Face tokenizers'
        self.slots = trio.CapacityLimiter(limits.tokenizer_threads)
        self.queued_chars = 0  # characters of prompts admitted to tokenizing and not yet tokenized

    async def request(self, body: dict[str, Any], *, chat: bool, model: str) -> GenerateRequest:
        chars, ids = prompt_size(body, chat=chat)
        self._check_size(chars, ids)
        text = _Text()
        try:
            # A chat the model's template renders is not rendered here too (copying megabytes on the event loop).
            render = _unrendered if chat and self.model is not None else render_chat
            request = parse_request(body, chat=chat, model=model, tokenizer=text, forwarded=True, render=render)
        except RequestProblem as problem:
            raise Refusal(error_response(problem.status, problem.message)) from None
        if text.text is None:  # token ids: already counted
            return request
        if chat and self.model is not None:
            # Always on a tokenizer thread: the template is the model directory's code, bounded in time and steps
            # (template_sandbox.py) but not cheap enough to run on the event loop.
            prompt = await self._admitted(chars, partial(self._chat_ids, body))
        elif len(text.text) <= INLINE_CHARS:
            prompt = self.tokenize(text.text)
        else:
            sliced = text.text if self.on_loop else None
            prompt = await self._admitted(len(text.text), partial(self._capped, text.text, self.tokenize), sliced)
        if not prompt:
            raise Refusal(error_response(400, "the prompt is empty: it must have at least one token"))
        if len(prompt) > self.limits.max_prompt_tokens:
            await _drop(prompt)
            raise Refusal(error_response(400, self._too_many()))
        return attrs.evolve(request, prompt=prompt)

    def _check_size(self, chars: int, ids: int) -> None:
        limits = self.limits
        if ids > limits.max_prompt_tokens:
            raise Refusal(error_response(400, self._too_many(ids)))
        if chars > limits.max_prompt_chars:
            message = (
                f"the prompt has {chars} characters; this frontend tokenizes at most {limits.max_prompt_chars} "
                f"({PROMPT_CHARS_PER_TOKEN} per token of --max-prompt-tokens {limits.max_prompt_tokens})"
            )
            raise Refusal(error_response(400, message))

    def _too_many(self, ids: int | None = None) -> str:
        """Token ids are counted; a text's tokenizing stops once it is over the limit."""
        limit = self.limits.max_prompt_tokens
        has = f"has {ids} token ids" if ids is not None else f"has more than {limit} tokens"
        return f"the prompt {has}; this frontend routes at most {limit} (--max-prompt-tokens)"

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        """A chat rendered with the model's template (bounded in bytes as it renders), then tokenized: a template's
        refusal is the request's 400."""
        assert self.model is not None
        try:
            rendered = self.model.render_chat(body, self.limits.max_prompt_chars)
        except ChatRefused as exc:
            raise Refusal(error_response(400, str(exc))) from None
        return self._capped(rendered, self.model.chat_ids)

    async def _admitted(self, chars: int, work: Callable[[], list[int]], sliced: str | None = None) -> list[int]:
        """``work`` on a tokenizer thread once admitted (``sliced``: the built-in tokenizer's text, on the loop)."""
        limit = self.limits.tokenize_queue_chars
        if self.queued_chars and self.queued_chars + chars > limit:
            message = (
                f"the frontend is busy tokenizing: {self.queued_chars} characters of prompts are queued and at most "
                f"{limit} may be (--max-tokenizing-chars); retry"
            )
            raise Refusal(error_response(503, message, ((b"retry-after", b"1"),)))
        self.queued_chars += chars
        try:
            if sliced is not None:
                async with self.slots:
                    return await self._in_slices(sliced)
            return await trio.to_thread.run_sync(work, limiter=self.slots)
        finally:
            self.queued_chars -= chars

    async def _in_slices(self, text: str) -> list[int]:
        """The built-in tokenizer a slice at a time, other tasks running between slices; past the limit, the ids
        so far (the count is then over it: nothing more is needed to refuse)."""
        ids: list[int] = []
        for part in slices(text):
            await trio.lowlevel.checkpoint()
            ids.extend(self.tokenize(part))
            if len(ids) > self.limits.max_prompt_tokens:
                break
        return ids

    def _capped(self, text: str, encode: Tokenize) -> list[int]:
        """On a worker thread: the ids, or (over the limit) ids enough to say so, the rest dropped here; a text that
        counts over the limit a slice at a time is refused before it is tokenized whole."""
        limit = self.limits.max_prompt_tokens
        if (
            self.count is not None
            and len(text) > limit
            and count_over(text, self.count, limit, count_slice_chars(limit))
        ):
            raise Refusal(error_response(400, self._too_many()))
        ids = encode(text)
        while len(ids) > self.limits.max_prompt_tokens + 1:
            del ids[max(self.limits.max_prompt_tokens + 1, len(ids) - FREE_STEP) :]
        return ids


def count_slice_chars(limit: int) -> int:
    """Slices about as long as the limit in characters (a normal text has fewer tokens than characters, so the first
    few slices of a text over the limit are over it), between ``SLICE_CHARS`` and ``COUNT_SLICE_MAX``."""
    return min(max(limit, SLICE_CHARS), COUNT_SLICE_MAX)


def count_over(text: str, count: Callable[[str], int], limit: int, size: int) -> bool:
    """Whether ``text`` has more than ``limit`` tokens, by ``count``ing its slices of about ``size`` characters in turn
    and stopping as soon as their sum passes ``limit`` (plus ``CUT_SLACK`` per cut so far)."""
    total = 0
    for cuts, part in enumerate(slices(text, size)):
        total += count(part)
        if total > limit + cuts * CUT_SLACK:
            return True
    return False


async def _drop(ids: list[int]) -> None:
    """Empty a refused prompt's ids a step at a time, other tasks running between steps."""
    while ids:
        del ids[-FREE_STEP:]
        await trio.lowlevel.checkpoint()
