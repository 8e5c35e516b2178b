"""A tokenizer that needs no download: hashed word and identifier pieces.

Text is split into words (identifiers, numbers); each identifier is further split at
underscores and camelCase boundaries and lower-cased, so ``getSourceSegment`` and
``get_source_segment`` both give ``get source segment``. Each piece, and each pair of
neighbouring pieces (bigram), is hashed with CRC-32 (stable across processes and
machines, unlike Python's salted ``hash``) into ``buckets - 1`` ids; id 0 is padding.
Different pieces may share an id (hash collisions); with 2**18 buckets that is rare.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from typing import Dict, List, Sequence

import torch
from torch import Tensor

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")  # ASCII text: identifiers and numbers
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def _in_word(ch: str) -> bool:
    r"""A character that continues a word: what Python's ``\w`` matches (letters, all numerals,
    ``_``) and combining marks (Devanagari vowel signs, Hebrew points), which ``\w`` lacks."""
    return ch.isalnum() or ch == "_" or unicodedata.category(ch)[0] == "M"


def words(text: str) -> List[str]:
    r"""Words (a ``\w`` character that is not a decimal digit, then word characters and marks) and
    runs of decimal digits, in order. ASCII text takes the regex; other text is NFC-normalised and
    scanned (``\w`` alone would cut ``हिन्दी`` apart at its vowel signs). Both give the same words
    for ASCII characters."""
    if text.isascii():
        return _WORD.findall(text)
    text = unicodedata.normalize("NFC", text)
    out, i, n = [], 0, len(text)
    while i < n:
        ch, j = text[i], i + 1
        if ch.isdecimal():
            while j < n and text[j].isdecimal():
                j += 1
            out.append(text[i:j])
        elif ch.isalnum() or ch == "_":
            while j < n and _in_word(text[j]):
                j += 1
            out.append(text[i:j])
        i = j
    return out


def pieces(text: str) -> List[str]:
    """Lower-cased word pieces of ``text`` in order (identifiers split at ``_`` and, when ASCII, at
    camelCase boundaries; a part with other letters, ``кошка``, ``naïve`` or ``हिन्दी``, is one piece)."""
    out: List[str] = []
    for word in words(text):
        for part in word.split("_"):
            if part and part.isascii():
                out.extend(p.lower() for p in _CAMEL.findall(part))
            elif part:
                out.append(part.lower())
    return out


class HashTokenizer:
    """Maps texts to padded id matrices: unigram ids then bigram ids, at most ``max_length``.

    Args:
        buckets: number of ids including the padding id 0 (the embedding table's rows).
        max_length: ids per text (unigrams first: up to ``max_length // 2`` pieces are kept,
            then their bigrams fill the rest).
        bigrams: whether to add hashed bigrams of neighbouring pieces.
    """

    def __init__(self, buckets: int = 2**18, max_length: int = 128, bigrams: bool = True) -> None:
        if buckets < 2:
            raise ValueError(f"buckets must be >= 2 (id 0 is padding), got {buckets}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.buckets = buckets
        self.max_length = max_length
        self.bigrams = bigrams

    def _id(self, piece: str) -> int:
        return 1 + zlib.crc32(piece.encode("utf-8")) % (self.buckets - 1)

    def ids(self, text: str) -> List[int]:
        """The ids of one text (no padding), length <= ``max_length``."""
        ps = pieces(text)
        if not self.bigrams:
            return [self._id(p) for p in ps[: self.max_length]]
        ps = ps[: max(1, self.max_length // 2)]
        uni = [self._id(p) for p in ps]
        bi = [self._id(a + " " + b) for a, b in zip(ps, ps[1:])]
        return (uni + bi)[: self.max_length]

    def __call__(self, texts: Sequence[str], max_length: int | None = None) -> Dict[str, Tensor]:
        """``{"input_ids": (N, L) int64, "attention_mask": (N, L) int64}``, L = longest text.

        A text with no pieces (e.g. only punctuation) gets a single padding id and an
        all-zero mask; the encoder maps it to a zero bag.
        """
        seqs = [self.ids(t) for t in texts]
        if max_length is not None:
            seqs = [s[:max_length] for s in seqs]
        width = max(1, max((len(s) for s in seqs), default=1))
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            if s:
                ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return {"input_ids": ids, "attention_mask": (ids != 0).to(torch.int64)}
