"""Subword tokenizer (HuggingFace ``tokenizers`` WordPiece) for the text models.

Normalisation: Unicode NFD, lowercase, strip accents. Pre-tokenisation: split on whitespace
and between words and punctuation runs. Special tokens have fixed ids: ``[PAD]``=0, ``[UNK]``=1,
``[CLS]``=2, ``[SEP]``=3, ``[MASK]``=4. Every encoded sequence starts with ``[CLS]``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4, in this order
CHARS_PER_TOKEN = 8  # generous upper bound for English text (IMDb averages ~4.7)
Truncation = Literal["head", "head_tail"]
HEAD_SHARE = 0.25  # head_tail keeps the first quarter and the last three quarters of the
# budget: Sun et al. 2019 found head 128 + tail 382 of 512 best on IMDb (the verdict is
# usually at the end of a review)


def text_problem(value: str) -> str | None:
    """Why ``value`` is no text the tokenizer (or a JSON answer, a log, a file name) can take,
    or None: a lone surrogate (a JSON "\\ud800" escape, a tar member's name that was not
    UTF-8) cannot be written as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode at character {e.start} (a lone surrogate)"
    return None


def head_tail_cut(n: int, budget: int) -> tuple[int, int]:
    """How many leading and trailing pieces of ``n`` to keep within ``budget``."""
    if n <= budget:
        return n, 0
    head = int(budget * HEAD_SHARE)
    return head, budget - head


def renumber_pieces(tok: Tokenizer) -> None:
    """Give ``tok``'s WordPiece model the ids: special tokens first (fixed), then the pieces in
    sorted order. The trainer numbers pieces of equal rank in a different order from run to
    run, so the same texts gave the same pieces under different ids, and a seed or a cache did
    not reproduce a model. WordPiece segments by the set of pieces, so encodings keep their
    pieces. (On tie-heavy toy corpora the trainer can also pick a different set.)"""
    pieces = sorted(t for t in tok.get_vocab() if t not in SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *pieces))}
    old = tok.model  # the same settings, only the ids change
    tok.model = models.WordPiece(vocab, unk_token=old.unk_token,
                                 max_input_chars_per_word=old.max_input_chars_per_word,
                                 continuing_subword_prefix=old.continuing_subword_prefix)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2
) -> Tokenizer:
    """Train a WordPiece tokenizer on ``texts`` (special tokens get ids 0..4)."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()]
    )
    # split on whitespace and between word characters and punctuation (\w+|[^\w\s]+):
    # cheaper than BertPreTokenizer, which isolates every punctuation character
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    renumber_pieces(tok)
    # For users of the raw tokenizer JSON: encode() adds [CLS] like TextTokenizer does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A",
        pair=f"{CLS} $A {SEP} $B {SEP}",
        special_tokens=[(CLS, SPECIAL_TOKENS.index(CLS)), (SEP, SPECIAL_TOKENS.index(SEP))],
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


@dataclass
class _Pieces:
    ids: list[int]
    tokens: list[str]
    truncated: bool


@dataclass
class Encoded:
    """A padded batch: ``[CLS]`` + pieces, right-padded to the longest row."""

    input_ids: torch.Tensor  # (B, T) int64, T = longest row (<= max_len)
    attention_mask: torch.Tensor  # (B, T) bool, True for real tokens (incl. [CLS])
    truncated: list[bool]  # row i lost tokens to max_len
    pieces: list[list[str]]  # row i's tokens, without padding

    def tokens(self, i: int) -> list[str]:
        """Token strings of row ``i`` aligned with ``input_ids[i]`` (padding excluded)."""
        return list(self.pieces[i])

    @property
    def lengths(self) -> torch.Tensor:  # (B,) int64 number of real tokens per row
        return self.attention_mask.sum(dim=1)


class TextTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with fixed special ids and batch encoding helpers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.tokenizer = tokenizer
        self.pad_id: int = tokenizer.token_to_id(PAD)
        self.unk_id: int = tokenizer.token_to_id(UNK)
        self.cls_id: int = tokenizer.token_to_id(CLS)
        self.sep_id: int = tokenizer.token_to_id(SEP)
        self.mask_id: int = tokenizer.token_to_id(MASK)
        self._truncating: dict[int, Tokenizer] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ construction / IO

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2
    ) -> TextTokenizer:
        """Train a new tokenizer (see :func:`train_tokenizer`)."""
        return cls(train_tokenizer(texts, vocab_size=vocab_size, min_frequency=min_frequency))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def pieces(self) -> list[str]:
        """Every piece of the vocabulary, by id (``##`` marks a continuation)."""
        by_id = [""] * self.vocab_size
        for piece, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            by_id[i] = piece
        return by_id

    def to_str(self) -> str:
        """The tokenizer as its JSON string."""
        return self.tokenizer.to_str()

    @classmethod
    def from_str(cls, data: str) -> TextTokenizer:
        return cls(Tokenizer.from_str(data))

    def save(self, path: str | Path) -> None:
        """Write the tokenizer JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_str(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)))

    # ------------------------------------------------------------------ encoding

    def _encoder(self, max_len: int) -> Tokenizer:
        """A copy of the tokenizer truncating to ``max_len - 1`` pieces (room for [CLS])."""
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 ([CLS] + one token), got {max_len}")
        with self._lock:
            enc = self._truncating.get(max_len)
            if enc is None:
                enc = Tokenizer.from_str(self.tokenizer.to_str())
                enc.no_padding()
                enc.enable_truncation(max_length=max_len - 1, stride=0, direction="right")
                self._truncating[max_len] = enc
            return enc

    def _encode(self, texts: Sequence[str], max_len: int,
                truncation: Truncation = "head") -> list[_Pieces]:
        """Truncated encodings (no special tokens) of ``texts``, batch-encoded in parallel.

        Long texts are first cut at a space after ``CHARS_PER_TOKEN * max_len`` characters:
        with whitespace-splitting pre-tokenisation the leading pieces are unchanged, so when
        the cut text still overflows the result equals encoding the full text; rows that no
        longer overflow are re-encoded in full. This skips most of the work on long reviews.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        texts = list(texts)
        if truncation == "head_tail":
            return self._encode_head_tail(texts, max_len)
        if truncation != "head":
            raise ValueError(f"unknown truncation {truncation!r}; use head or head_tail")
        encoder = self._encoder(max_len)
        limit = CHARS_PER_TOKEN * max_len
        clipped, was_cut = [], []
        for t in texts:
            cut = t.rfind(" ", limit // 2, limit) if len(t) > limit else -1
            clipped.append(t[:cut] if cut > 0 else t)
            was_cut.append(cut > 0)
        encs = encoder.encode_batch(clipped, add_special_tokens=False)
        redo = [i for i, e in enumerate(encs) if was_cut[i] and not e.overflowing]
        if redo:
            full = encoder.encode_batch([texts[i] for i in redo], add_special_tokens=False)
            for i, e in zip(redo, full, strict=True):
                encs[i] = e
        return [_Pieces(e.ids, e.tokens, len(e.overflowing) > 0) for e in encs]

    def _encode_head_tail(self, texts: list[str], max_len: int) -> list[_Pieces]:
        """The first and the last pieces of each text (:func:`head_tail_cut`)."""
        self._encoder(max_len)  # validates max_len
        with self._lock:
            full = self._truncating.get(0)
            if full is None:  # no truncation, no padding
                full = Tokenizer.from_str(self.tokenizer.to_str())
                full.no_padding()
                full.no_truncation()
                self._truncating[0] = full
        out = []
        for e in full.encode_batch(texts, add_special_tokens=False):
            ids, toks = e.ids, e.tokens
            head, tail = head_tail_cut(len(ids), max_len - 1)
            if tail:
                ids, toks = ids[:head] + ids[-tail:], toks[:head] + toks[-tail:]
            out.append(_Pieces(ids, toks, tail > 0))
        return out

    def encode_batch(self, texts: Sequence[str], max_len: int,
                     truncation: Truncation = "head") -> Encoded:
        """``[CLS]`` + pieces per text, truncated to ``max_len`` (keeping the head, or the head
        and the tail), right-padded to the longest."""
        encs = self._encode(texts, max_len, truncation)
        rows = [[self.cls_id, *e.ids] for e in encs]
        width = max((len(r) for r in rows), default=1)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, T)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = True
        return Encoded(
            input_ids=ids,
            attention_mask=mask,
            truncated=[e.truncated for e in encs],
            pieces=[[CLS, *e.tokens] for e in encs],
        )

    def encode_to_arrays(
        self, texts: Sequence[str], max_len: int, chunk_size: int = 4096,
        truncation: Truncation = "head",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pre-tokenise a whole dataset: ids (N, max_len) int32 padded, lengths (N,) int64.

        Same layout as :meth:`encode_batch` but always padded to ``max_len``. Uses the
        tokenizer's multi-threaded batch encoding, ``chunk_size`` texts at a time.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        self._encoder(max_len)  # validates max_len
        n = len(texts)
        ids = np.full((n, max_len), self.pad_id, dtype=np.int32)  # (N, max_len)
        lengths = np.zeros(n, dtype=np.int64)  # (N,) real tokens incl. [CLS]
        ids[:, 0] = self.cls_id
        for start in range(0, n, chunk_size):
            encs = self._encode(texts[start : start + chunk_size], max_len, truncation)
            for j, e in enumerate(encs):
                row = e.ids
                ids[start + j, 1 : 1 + len(row)] = row
                lengths[start + j] = 1 + len(row)
        return ids, lengths

    def decode(self, ids: Sequence[int] | torch.Tensor | np.ndarray) -> str:
        """Ids back to text (special tokens and padding dropped)."""
        if isinstance(ids, torch.Tensor | np.ndarray):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
