"""What the frontend tokenizes prompts with: the mock worker's built-in tokenizer, or a Hugging Face
``tokenizer.json`` read from disk (never downloaded) through the optional ``tokenizers`` package
(``pip install 'kvrouter[hf]'``).

Routing only needs the same ids the workers cache: with mock workers that is the built-in tokenizer; with real
engines it is the model's own tokenizer file.

A Hugging Face tokenizer is called through ``encode_batch_fast`` with a batch of one text, never ``encode``:
``tokenizers``' ``Tokenizer.encode`` holds the GIL for the whole encoding (about 10 s for 6 MB of text, during which
the frontend's event loop, waiting for the GIL, answers nothing), while its batch methods release it; ``_fast`` skips
the character offsets, which routing does not use (the ids are the same).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrouter.api.openai.tokenizer import tokenize as builtin_tokenize

Tokenize = Callable[[str], list[int]]
BUILTIN = "built-in"


class TokenizerUnavailable(ValueError):
    """The tokenizer file cannot be used; ``str`` is one line saying why and what to do."""


def hf_ids(tokenizer: Any, text: str, *, special_tokens: bool) -> list[int]:
    """The ids of ``text``, the GIL released while the tokenizer works (see the module docstring)."""
    ids: list[int] = tokenizer.encode_batch_fast([text], add_special_tokens=special_tokens)[0].ids
    return ids


def hf_count(tokenizer: Any, text: str) -> int:
    """How many tokens ``text`` has (no special tokens added), the GIL released, no ids built in Python."""
    return len(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])


class HfTokenizer:
    """``--tokenizer FILE``: a ``tokenizer.json``'s ids, no special tokens added; ``count`` lets the frontend count a
    long prompt a slice at a time and refuse it before tokenizing the rest (``tokenizing.py``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return hf_ids(self._tokenizer, text, special_tokens=False)

    def count(self, text: str) -> int:
        return hf_count(self._tokenizer, text)


def load_tokenizer(path: Path | None) -> tuple[Tokenize, str]:
    """The tokenize function and a name for the logs: the built-in one without ``path``."""
    if path is None:
        return builtin_tokenize, BUILTIN
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise TokenizerUnavailable(
            f"--tokenizer {path}: the 'tokenizers' package is not installed; install kvrouter[hf] "
            "(pip install 'kvrouter[hf]') or drop --tokenizer to use the built-in tokenizer"
        ) from None
    if not path.is_file():
        raise TokenizerUnavailable(f"--tokenizer {path}: no such file (give a Hugging Face tokenizer.json)")
    try:
        tokenizer: Any = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception types
        raise TokenizerUnavailable(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({exc})") from None
    return HfTokenizer(tokenizer), str(path)
