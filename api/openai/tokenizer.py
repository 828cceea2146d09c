"""The built-in tokenizer: deterministic, nothing to download, the same ids on every run and platform.

A text is cut into pieces, each a run of word characters or one other non-blank character, together with
the blanks before it (``"Hi, you"`` -> ``"Hi"``, ``","``, ``" you"``); blanks at the end are one more piece.
Joining the pieces gives the text back, so nothing is lost. A piece's id is the xxh3-64 hash of its UTF-8
bytes modulo 2**31 (``VOCAB_SIZE``): equal texts give equal ids and a shared text prefix gives a shared id
prefix (up to the piece the texts start to differ in), which is all prefix caching needs. Ids are not
reversible; generated text comes from ``OUTPUT_WORDS`` and is tokenized by the same rule, so a later prompt
that quotes an answer (a multi-turn chat) finds the answer's blocks cached.

Chat messages are rendered as ``<|role|>\\n{content}\\n`` per message, then ``<|assistant|>\\n``, and that
text is tokenized. ``\\w`` follows Python's Unicode tables (stable within a Python release).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

from xxhash import xxh3_64_intdigest

VOCAB_SIZE = 1 << 31  # ids are u32 and stay below 2**31, clear of the engine's own generated-token range
_PIECES = re.compile(r"\s*(?:\w+|[^\w\s])|\s+")
# Where a text can be cut without changing its pieces: between a non-blank and the blank after it (a piece ends
# at the non-blank, the next starts at the blank). Long texts are tokenized a slice at a time, so no single call
# into the regex engine (which holds the GIL) runs long: a frontend tokenizing on a thread stays responsive.
_CUT = re.compile(r"\S\s")
SLICE_CHARS = 16 * 1024

_WORDS = (
    "the of and a to in is it that for on with as was at by this be from or an are not have but they "
    "one all were we when there can more if no out so up said what about into than them only other new "
    "some could time these two may then do first any now such like our over even most made after also "
    "did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three"
)
OUTPUT_WORDS = tuple(_WORDS.split(" "))


def tokenize(text: str) -> list[int]:
    """The ids of ``text`` (see the module docstring)."""
    if len(text) <= SLICE_CHARS:
        return [piece_id(piece) for piece in _PIECES.findall(text)]
    ids: list[int] = []
    for part in slices(text):
        ids.extend(piece_id(piece) for piece in _PIECES.findall(part))
    return ids


def slices(text: str, size: int = SLICE_CHARS) -> Iterator[str]:
    """``text`` cut where a blank follows a non-blank, about every ``size`` characters."""
    start = 0
    while len(text) - start > size:
        cut = _CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start : cut.start() + 1]
        start = cut.start() + 1
    yield text[start:]


def piece_id(piece: str) -> int:
    return xxh3_64_intdigest(piece.encode("utf-8")) % VOCAB_SIZE


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt text of a chat: each ``(role, content)`` in turn, then the assistant's cue."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


class OutputText:
    """Deterministic generated text: word ``i`` of an answer depends only on the prompt and ``i``, so the
    same prompt always gets the same answer (as greedy decoding would), and its ids are the tokenizer's."""

    __slots__ = ("_seed",)

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self._seed = xxh3_64_intdigest(b"".join(i.to_bytes(4, "little") for i in prompt_ids[-64:]))

    def piece(self, index: int) -> str:
        word = OUTPUT_WORDS[(self._seed + index * 7919) % len(OUTPUT_WORDS)]
        return word if index == 0 else " " + word

    def token(self, index: int) -> int:
        return piece_id(self.piece(index))
