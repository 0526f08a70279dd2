"""The n-gram heads of a text model: linear models of the binary bag of n-grams in its input,
fitted by NB-LR apart from the Transformer (``training/ngram_teacher.py``), kept in buffers.

* :class:`NgramHead` (``ngram_head_unit: token``): the model's WordPiece tokens, and hashed
  token pairs (and triples).
* :class:`WordNgramHead` (``ngram_head_unit: word``): words formed from the pieces (a piece and
  the ``##`` pieces after it), hashed word unigrams and bigrams: nearly the NB-LR teacher's
  features (it keeps "don't" whole, the head makes "don" and "t"), computed from token ids
  alone, so the head needs no text.

Both answer ``forward(ids, mask) -> (B, K)`` logits (without the Transformer's), ``features``
(the distinct feature ids of each row, what NB-LR is fitted on) and ``contributions`` (each
position's exact share of the logits, for explanations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def check_ngram_head(buckets: int, order: int) -> None:
    """An n-gram head's shape: order 2 or 3, and with buckets, at least one per n-gram length
    (order 3 halves them; zero buckets for pairs would divide by zero when hashing)."""
    if order not in (2, 3):
        raise ValueError(f"ngram_head_order must be 2 or 3, got {order}")
    if 0 < buckets < order - 1:
        raise ValueError(f"ngram_head_buckets must be 0 (no head) or >= {order - 1} with "
                         f"ngram_head_order {order}, got {buckets}")


PAIR_MUL = (2_654_435_761, 40_503)  # multiplicative hash of a (previous, current) token pair


def pair_buckets(prev: Tensor, cur: Tensor, buckets: int) -> Tensor:
    """Bucket of each (previous, current) id pair; int64 products stay < 2^63 for ids < 2^31."""
    return (prev.long() * PAIR_MUL[0] + cur.long() * PAIR_MUL[1]).remainder(buckets)


def _repeats(f: Tensor) -> Tensor:
    """``(B, L)``: True where a row of sorted ids ``f`` ``(B, L)`` repeats its left neighbour."""
    return F.pad(f[:, 1:] == f[:, :-1], (1, 0), value=False)


def _bag_logits(head: nn.Module, f: Tensor) -> Tensor:
    """``(B, K)``: the bias plus the weights of the feature ids ``f`` ``(B, F)`` (-1: none)."""
    w = head.weight[f.clamp_min(0)] * (f >= 0).unsqueeze(-1).to(head.weight.dtype)  # (B, F, K)
    return w.sum(1) + head.bias  # (B, K)


def _distinct(pf: Tensor) -> Tensor:
    """``(B, n, T)`` feature ids -> ``(B, nT)`` each row's distinct ids (sorted); -1 fills the
    rest (none, repeats)."""
    f = pf.flatten(1).sort(1).values
    return f.masked_fill(_repeats(f), -1)  # (B, nT)


def _first_weights(weight: Tensor, pf: Tensor) -> Tensor:
    """``(B, n, T, K)``: the weight of each feature id of ``pf`` ``(B, n, T)`` at its first
    occurrence in the row (row-major over ``(n, T)``), 0 at repeats and at -1."""
    B, n, T = pf.shape
    flat = pf.flatten(1)  # (B, nT)
    s, where = flat.sort(dim=1, stable=True)  # equal ids keep their order: earliest first
    first = (s >= 0) & ~_repeats(s)  # (B, nT)
    first = torch.zeros_like(first).scatter(1, where, first)  # back in position order
    w = weight[flat.clamp_min(0)] * first.unsqueeze(-1).to(weight.dtype)  # (B, nT, K)
    return w.view(B, n, T, -1)


class NgramHead(nn.Module):
    """A linear model of the binary bag of n-grams: ``logits (B, K)`` = the sum of the weights
    of the distinct tokens and token pairs (and triples, ``order`` 3) present, plus a bias.
    ``weight`` rows ``0..V-1`` are the tokens, ``V..V+buckets-1`` the hashed n-grams (with
    ``order`` 3: pairs in the first half, triples in the second). The weights are buffers
    (saved with the model, never updated by the optimiser): they are set by
    ``training.ngram_teacher.fit_ngram_head`` (NB-LR)."""

    def __init__(self, vocab_size: int, buckets: int, num_classes: int, order: int = 2) -> None:
        super().__init__()
        if buckets < 1:
            raise ValueError(f"an n-gram head needs >= 1 bucket, got {buckets}")
        check_ngram_head(buckets, order)
        self.vocab_size, self.buckets, self.order = vocab_size, buckets, order
        self.pair_buckets = buckets if order == 2 else buckets // 2
        self.register_buffer("weight", torch.zeros(vocab_size + buckets, num_classes))
        self.register_buffer("bias", torch.zeros(num_classes))

    @property
    def num_features(self) -> int:
        return self.vocab_size + self.buckets

    def position_features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, order, T)``: the feature id of the n-gram of each length ending at each
        position (row 0 the token, 1 the pair, 2 the triple); -1 where one of its tokens is
        padding or masked out."""
        ids, m = input_ids.long(), attention_mask
        V = self.vocab_size
        prev = F.pad(ids[:, :-1], (1, 0))  # (B, T)
        pair_ok = F.pad(m[:, :-1], (1, 0), value=False) & m  # (B, T)
        rows = [ids.masked_fill(~m, -1),
                (V + pair_buckets(prev, ids, self.pair_buckets)).masked_fill(~pair_ok, -1)]
        if self.order == 3:  # (padding first, then cut: a [CLS]-only row has T = 1)
            T = ids.shape[1]
            prev2 = F.pad(ids, (2, 0))[:, :T]  # (B, T)
            triple_ok = F.pad(m, (2, 0), value=False)[:, :T] & pair_ok
            first_two = pair_buckets(prev2, prev, 2**31)  # < 2^31: the next product fits int64
            triples = V + self.pair_buckets + pair_buckets(
                first_two, ids, self.buckets - self.pair_buckets)
            rows.append(triples.masked_fill(~triple_ok, -1))
        return torch.stack(rows, 1)  # (B, order, T)

    def features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, order * T)`` feature ids of each row's n-grams of real tokens, each once
        (sorted); -1 fills the rest (padding, masked-out tokens, repeats)."""
        return _distinct(self.position_features(input_ids, attention_mask))  # (B, order * T)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return _bag_logits(self, self.features(input_ids, attention_mask))

    def contributions(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, T, K)``: each position's share of the logits, exactly: an n-gram's weight is
        counted at its first occurrence and split evenly over its tokens, so the shares sum
        over the positions to ``forward(...) - bias``."""
        pf = self.position_features(input_ids, attention_mask)  # (B, n, T)
        B, n, T = pf.shape
        w = _first_weights(self.weight, pf)  # (B, n, T, K): row k is the (k+1)-gram ending at t
        out = torch.zeros(B, T, w.shape[-1], dtype=w.dtype, device=w.device)  # (B, T, K)
        for k in range(n):
            share = w[:, k] / (k + 1)
            for j in range(k + 1):  # the (k+1)-gram ending at t covers t-k..t
                out[:, : T - j] += share[:, j:]
        return out


# --- words -----------------------------------------------------------------------------------

PIECE_START, PIECE_CONT, PIECE_SKIP = 0, 1, 2  # a piece starts a word, continues one, is skipped
P31 = 2**31 - 1  # a prime: word keys and buckets are polynomial hashes modulo it, in int64
# without overflow (operands < 2^31), and mod a prime every bit of a key reaches the bucket
# (a multiplicative hash mod 2^k mixes only low bits into low bits: 0.08 lower on IMDb)
WORD_BASE = 1_000_003  # the polynomial's base over a word's piece ids
UNI_MUL, BI_MUL, BI_MUL2 = 48_271, 69_621, 16_807  # unigrams and bigrams hashed apart
MAX_WORD_PIECES = 64  # pieces past this in one word share the last power (still hashed)
_POWERS = torch.tensor([pow(WORD_BASE, j, P31) for j in range(MAX_WORD_PIECES)])


def piece_kinds(pieces: Sequence[str]) -> Tensor:
    """``(V,)`` int8 kind of each vocabulary piece (``pieces[i]``: the piece of id ``i``):
    ``##`` pieces continue a word; special tokens (``[CLS]``...) and pieces with no letter or
    digit other than ``!`` and ``?`` (commas, quotes, ``<br />``'s parts) are skipped, as the
    NB-LR teacher's token pattern skips them; any other starts a word."""
    kinds = []
    for p in pieces:
        core = p[2:] if p.startswith("##") else p
        if (p.startswith("[") and p.endswith("]") and len(p) > 2) or not (
                any(c.isalnum() for c in core) or core in ("!", "?")):
            kinds.append(PIECE_SKIP)
        else:
            kinds.append(PIECE_CONT if p.startswith("##") else PIECE_START)
    return torch.tensor(kinds, dtype=torch.int8)


class WordNgramHead(nn.Module):
    """A linear model of the binary bag of words and word pairs, from token ids: a word is a
    piece and the ``##`` pieces after it (skipped pieces, see :func:`piece_kinds`, end a word
    and do not separate pairs: "great, fun" is the pair (great, fun)). Each word is hashed to
    a 31-bit key (a polynomial over its piece ids mod :data:`P31`), then unigrams and bigrams
    to one of ``buckets`` rows of ``weight``. ``piece_kind`` (saved with the model) comes from
    the tokenizer's vocabulary (:meth:`read_pieces`, before fitting); until then every piece
    is a word."""

    def __init__(self, vocab_size: int, buckets: int, num_classes: int) -> None:
        super().__init__()
        if buckets < 1:
            raise ValueError(f"a word n-gram head needs >= 1 bucket, got {buckets}")
        self.vocab_size, self.buckets = vocab_size, buckets
        self.register_buffer("piece_kind", torch.zeros(vocab_size, dtype=torch.int8))
        self.register_buffer("weight", torch.zeros(buckets, num_classes))
        self.register_buffer("bias", torch.zeros(num_classes))
        # moved with the model, so a GPU forward copies nothing; derived, so not saved
        self.register_buffer("powers", _POWERS.clone(), persistent=False)

    @property
    def num_features(self) -> int:
        return self.buckets

    def read_pieces(self, pieces: Sequence[str]) -> None:
        """Take each piece's kind from the vocabulary ``pieces`` (by id)."""
        if len(pieces) != self.vocab_size:
            raise ValueError(f"{len(pieces)} pieces for a vocabulary of {self.vocab_size}")
        self.piece_kind.copy_(piece_kinds(pieces))

    def words(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``keys`` ``(B, T)``: the key of each row's w-th word at column w, -1 past its last
        word; ``word_of`` ``(B, T)``: the word each position belongs to, -1 for padding,
        masked-out and skipped pieces (a masked-out piece also ends its word)."""
        ids = input_ids.long()
        B, T = ids.shape
        kind = self.piece_kind[ids].long()  # (B, T)
        kept = attention_mask & (kind != PIECE_SKIP)  # (B, T)
        prev_kept = F.pad(kept[:, :-1], (1, 0), value=False)  # (B, T)
        start = kept & ((kind != PIECE_CONT) | ~prev_kept)  # (B, T)
        word_of = (start.long().cumsum(1) - 1).masked_fill(~kept, -1)  # (B, T)
        t = torch.arange(T, device=ids.device).expand(B, T)  # (B, T)
        first = torch.where(start, t, torch.zeros_like(t)).cummax(1).values  # word's first piece
        powers = self.powers[(t - first).clamp_max(MAX_WORD_PIECES - 1)]  # (B, T)
        terms = ((ids + 1) * powers).remainder(P31).masked_fill(~kept, 0)  # (B, T) < 2^31
        keys = torch.zeros(B, T, dtype=torch.long, device=ids.device)
        keys = keys.scatter_add(1, word_of.clamp_min(0), terms).remainder(P31)  # (B, T)
        n_words = start.sum(1, keepdim=True)  # (B, 1)
        return keys.masked_fill(t >= n_words, -1), word_of

    def word_features(self, keys: Tensor) -> Tensor:
        """``(B, 2, W)``: the bucket of word w's unigram (row 0) and of the bigram ending at
        word w (row 1), from ``keys`` ``(B, W)``; -1 where there is none."""
        ok = keys >= 0  # (B, W)
        uni = (keys * UNI_MUL + 1).remainder(P31).remainder(self.buckets).masked_fill(~ok, -1)
        prev = F.pad(keys[:, :-1], (1, 0), value=-1)  # (B, W)
        pair = ((prev * BI_MUL).remainder(P31) + keys + 2).remainder(P31)
        bi = (pair * BI_MUL2).remainder(P31).remainder(self.buckets)
        bi = bi.masked_fill(~(ok & (prev >= 0)), -1)
        return torch.stack([uni, bi], 1)  # (B, 2, W)

    def features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, 2T)`` each row's distinct word unigram and bigram buckets (sorted), -1 fills."""
        keys, _ = self.words(input_ids, attention_mask)
        return _distinct(self.word_features(keys))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return _bag_logits(self, self.features(input_ids, attention_mask))

    def contributions(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, T, K)``: each position's share of the logits, exactly (they sum over the
        positions to ``forward(...) - bias``): a feature's weight counts at its first
        occurrence; a word's unigram goes to the word, a bigram's half to each of its words,
        and a word's share is split evenly over its pieces."""
        keys, word_of = self.words(input_ids, attention_mask)
        w = _first_weights(self.weight, self.word_features(keys))  # (B, 2, W, K)
        share = w[:, 0] + w[:, 1] / 2  # (B, W, K): unigram + the bigram ending at the word
        share[:, :-1] += w[:, 1, 1:] / 2  # the bigram starting at it (ending at the next)
        kept = word_of >= 0  # (B, T)
        idx = word_of.clamp_min(0)
        pieces = torch.zeros_like(keys).scatter_add(1, idx, kept.long())  # (B, W)
        per_piece = share / pieces.clamp_min(1).unsqueeze(-1).to(share.dtype)  # (B, W, K)
        out = per_piece.gather(1, idx.unsqueeze(-1).expand(-1, -1, share.shape[-1]))  # (B, T, K)
        return out * kept.unsqueeze(-1).to(out.dtype)


NgramHeads = NgramHead | WordNgramHead
