"""What the frontend tokenizes prompts with: the mock worker's built-in tokenizer, or a Hugging Face
``tokenizer.json`` read from disk (never downloaded) through the optional ``tokenizers`` package
(``pip install 'kvrouter[hf]'``).

Routing only needs the same ids the workers cache: with mock workers that is the built-in tokenizer; with real
engines it is the model's own tokenizer file.
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

    def hf_tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return hf_tokenize, str(path)
