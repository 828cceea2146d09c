"""``--tokenizer FILE``: a Hugging Face tokenizer.json read from disk through the optional ``tokenizers`` package
(``pip install 'kvrouter[hf]'``, also in the test extra). Skipped where the package is absent; the refusal without
it is tested in test_frontend_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrouter.api.frontend.tokenizers import TokenizerUnavailable, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def word_level_tokenizer(path: Path) -> Path:
    """A tiny word-level tokenizer.json, built by the library itself (no download)."""
    vocab = {word: index for index, word in enumerate(["[UNK]", "hello", "world", "the", "kv", "cache"])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_file_gives_the_ids_the_file_defines(tmp_path: Path) -> None:
    tokenize, _ = load_tokenizer(word_level_tokenizer(tmp_path / "tokenizer.json"))
    assert tokenize("hello world the kv cache unknown") == [1, 2, 3, 4, 5, 0]


def test_a_file_that_is_not_a_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    not_a_tokenizer = tmp_path / "tokenizer.json"
    not_a_tokenizer.write_text('{"model": 1}')
    with pytest.raises(TokenizerUnavailable) as refused:
        load_tokenizer(not_a_tokenizer)
    assert "not a Hugging Face tokenizer.json" in str(refused.value) and "\n" not in str(refused.value)
