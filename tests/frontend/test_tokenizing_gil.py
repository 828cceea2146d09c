"""A Hugging Face tokenizer (``--model-path``, ``--tokenizer``) on its tokenizer thread leaves the event loop free,
and a prompt far over ``--max-prompt-tokens`` is refused before it is tokenized whole (``docs/tokenizing.md``).

No clocks: the loop's progress is a counter a task of the loop bumps, read by the tokenizer thread as a call into the
tokenizer starts and ends; what was tokenized is the texts the tokenizer was called with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from kvrouter.api.frontend import tokenizing as tokenizing_module
from kvrouter.api.frontend.model_dir import ModelTokenizer, load_model_dir
from kvrouter.api.frontend.options import FrontendLimits
from kvrouter.api.frontend.tokenizers import load_tokenizer
from kvrouter.api.frontend.tokenizing import Tokenizing
from kvrouter.api.openai.body import Refusal
from tests.frontend.test_model_path import SENTENCES, expected_chat_ids, model_dir

pytest.importorskip("tokenizers")


class Recording:
    """A ``tokenizers.Tokenizer`` whose encoding calls note the text's length and the loop's ticks as they start and
    end (read on the tokenizer thread: a tokenizer holding the GIL lets no tick happen in between)."""

    def __init__(self, tokenizer: Any, ticks: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ticks = ticks
        self.calls: list[tuple[int, int]] = []  # (characters, ticks of the loop during the call)

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._tokenizer, name)
        if not name.startswith("encode"):
            return found

        def call(texts: Any, *args: Any, **kwargs: Any) -> Any:
            size = sum(map(len, texts)) if isinstance(texts, list) else len(texts)
            before = self._ticks[0]
            result = found(texts, *args, **kwargs)
            self.calls.append((size, self._ticks[0] - before))
            return result

        return call


def recorded(model: ModelTokenizer, ticks: list[int]) -> Recording:
    recording = Recording(model._tokenizer, ticks)
    model._tokenizer = recording
    return recording


async def ticking(ticks: list[int]) -> None:
    while True:
        await trio.sleep(0.001)
        ticks[0] += 1


async def test_the_event_loop_runs_while_the_models_tokenizer_works(nursery: trio.Nursery, tmp_path: Path) -> None:
    """tokenizers' ``Tokenizer.encode`` held the GIL for the whole text: 6 MB held the loop for seconds."""
    model = load_model_dir(model_dir(tmp_path / "model"))
    ticks = [0]
    recording = recorded(model, ticks)
    nursery.start_soon(ticking, ticks)
    tokenizing = Tokenizing(model, FrontendLimits())
    content = "fox " * 100_000  # 300,000 tokens: within the limit, tokenized whole in one call
    request = await tokenizing.request({"messages": [{"role": "user", "content": content}]}, chat=True, model="m")
    assert len(request.prompt) > 300_000
    size, ticked = max(recording.calls)
    assert size > len(content)
    assert ticked >= 5, recording.calls  # the loop went on while the tokenizer worked


@pytest.mark.parametrize("chat", [True, False])
async def test_a_prompt_far_over_the_limit_is_refused_before_it_is_tokenized_whole(tmp_path: Path, chat: bool) -> None:
    model = load_model_dir(model_dir(tmp_path / "model"))
    recording = recorded(model, [0])
    tokenizing = Tokenizing(model, FrontendLimits(max_prompt_tokens=5000))
    text = "fox " * 15_000  # 45,000 tokens, 60,000 characters: under the bound in characters (16 per token)
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    with pytest.raises(Refusal) as refused:
        await tokenizing.request(body, chat=chat, model="m")
    assert refused.value.response.status == 400
    assert b"more than 5000 tokens" in refused.value.response.body
    assert sum(size for size, _ in recording.calls) < len(text) // 2, recording.calls


async def test_a_prompt_at_the_limit_is_counted_in_slices_and_tokenized_whole(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "model")
    model = load_model_dir(path)
    recording = recorded(model, [0])
    messages = [{"role": "user", "content": " ".join(SENTENCES * 120)}]  # about 32,000 characters: two slices
    expected = expected_chat_ids(path, messages)
    tokenizing = Tokenizing(model, FrontendLimits(max_prompt_tokens=len(expected)))
    request = await tokenizing.request({"messages": messages}, chat=True, model="m")
    assert request.prompt == expected
    assert len(recording.calls) == 3, recording.calls  # two slices counted, then the whole text


async def test_a_tokenizer_file_counts_in_slices_too(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "model")
    tokenize, _ = load_tokenizer(path / "tokenizer.json")
    recording = Recording(getattr(tokenize, "_tokenizer", None), [0])
    tokenize._tokenizer = recording  # type: ignore[attr-defined]
    tokenizing = Tokenizing(tokenize, FrontendLimits(max_prompt_tokens=5000))
    with pytest.raises(Refusal) as refused:
        await tokenizing.request({"prompt": "fox " * 15_000}, chat=False, model="m")
    assert b"more than 5000 tokens" in refused.value.response.body
    assert recording.calls and sum(size for size, _ in recording.calls) < 30_000, recording.calls
    accepted = await tokenizing.request({"prompt": " ".join(SENTENCES * 20)}, chat=False, model="m")
    assert accepted.prompt == tokenize(" ".join(SENTENCES * 20))


async def test_a_chat_the_model_renders_is_not_rendered_on_the_event_loop_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body's check on the loop rendered the chat the built-in way (megabytes copied, then unused)."""
    seen: list[int] = []
    original = tokenizing_module._Text.__call__

    def noting(self: Any, text: str) -> list[int]:
        seen.append(len(text))
        return original(self, text)

    monkeypatch.setattr(tokenizing_module._Text, "__call__", noting)
    content = "fox " * 10_000
    tokenizing = Tokenizing(load_model_dir(model_dir(tmp_path / "model")), FrontendLimits())
    request = await tokenizing.request({"messages": [{"role": "user", "content": content}]}, chat=True, model="m")
    assert len(request.prompt) > 30_000
    assert seen and max(seen) < len(content), seen
    builtin = Tokenizing(tokenizing_module.builtin_tokenize, FrontendLimits())
    await builtin.request({"messages": [{"role": "user", "content": content}]}, chat=True, model="m")
    assert max(seen) > len(content)  # the built-in tokenizer tokenizes that rendering
