"""Transformer encoder for sentiment classification (text -> label).

Token embedding (with a padding index) -> positional encoding -> pre-norm blocks with a
key-padding mask -> final norm -> pooling (the ``[CLS]`` token or a masked mean) -> head.
Padding never influences real tokens: appending padding leaves the logits unchanged (tested).

With ``ngram_head_buckets`` the module also holds :class:`NgramHead`, a linear model of the
text's distinct tokens and hashed token pairs, fitted by the training run before the
Transformer trains (``training/ngram_teacher.py``) and never updated by the optimiser; in eval
mode (validation, serving) the logits are the mean of the Transformer's and the head's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit_service.models.layers import LN_EPS, Block, stack_layers
from vit_service.models.pos_encoding import PosEncoding, register_pos_embed


@dataclass
class TextConfig:
    vocab_size: int = 16000  # must equal the tokenizer's vocabulary size
    max_len: int = 256  # longest sequence (incl. [CLS]); longer inputs are truncated
    num_classes: int = 2  # negative / positive
    embed_dim: int = 256  # token width D
    depth: int = 4  # number of Transformer blocks
    num_heads: int = 4  # attention heads; D must divide by it
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * D
    qkv_bias: bool = True  # bias on the q, k, v projections
    pos_encoding: PosEncoding = "sinusoidal"  # sinusoidal (2017 formula, fixed) | learned
    pool: Literal["cls", "mean"] = "cls"  # [CLS] token (position 0) or mean over real tokens
    pad_id: int = 0  # tokenizer's [PAD] id: its embedding stays zero and it is masked out
    embed_scale: bool = True  # multiply embeddings by sqrt(D) (Vaswani et al.) so the
    # unit-amplitude sinusoidal table does not swamp them
    drop_rate: float = 0.1  # dropout on embeddings, projections and before the head
    attn_drop_rate: float = 0.0  # dropout on attention weights
    drop_path_rate: float = 0.0  # stochastic depth (max, linear over blocks)
    bigram_buckets: int = 0  # >0: add a hashed embedding of each (previous, current) token
    # pair (fastText-style bigrams; what makes linear models strong on IMDb); 0: off
    bigram_dim: int = 0  # width of the bigram table, projected to D; 0: D, no projection
    # (a narrow table holds more buckets, i.e. fewer hash collisions, for the same cost)
    ngram_head_buckets: int = 0  # >0: average (in eval mode) the logits with NgramHead's, a
    # linear model of the distinct tokens and (this many) hashed n-gram buckets fitted apart
    ngram_head_order: int = 2  # longest n-gram of the head: 2 (pairs take every bucket) or 3
    # (pairs take half, token triples the other half)

    def __post_init__(self) -> None:  # a job's bad override is refused before it runs
        check_ngram_head(self.ngram_head_buckets, self.ngram_head_order)


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
        f = self.position_features(input_ids, attention_mask).flatten(1).sort(1).values
        return f.masked_fill(_repeats(f), -1)  # (B, order * T)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        f = self.features(input_ids, attention_mask)  # (B, nT)
        w = self.weight[f.clamp_min(0)] * (f >= 0).unsqueeze(-1).to(self.weight.dtype)  # (B, nT, K)
        return w.sum(1) + self.bias  # (B, K)

    def contributions(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B, T, K)``: each position's share of the logits, exactly: an n-gram's weight is
        counted at its first occurrence and split evenly over its tokens, so the shares sum
        over the positions to ``forward(...) - bias``."""
        pf = self.position_features(input_ids, attention_mask)  # (B, n, T)
        B, n, T = pf.shape
        flat = pf.flatten(1)  # (B, nT)
        s, where = flat.sort(dim=1, stable=True)  # equal ids keep their order: earliest first
        first = (s >= 0) & ~_repeats(s)  # (B, nT)
        first = torch.zeros_like(first).scatter(1, where, first)  # back in position order
        w = self.weight[flat.clamp_min(0)] * first.unsqueeze(-1).to(self.weight.dtype)
        w = w.view(B, n, T, -1)  # (B, n, T, K): row k is the (k+1)-gram ending at t
        out = torch.zeros(B, T, w.shape[-1], dtype=w.dtype, device=w.device)  # (B, T, K)
        for k in range(n):
            share = w[:, k] / (k + 1)
            for j in range(k + 1):  # the (k+1)-gram ending at t covers t-k..t
                out[:, : T - j] += share[:, j:]
        return out


class TextTransformer(nn.Module):
    """Sentiment encoder; inputs are token ids ``(B, T)`` with ``[CLS]`` first."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim, padding_idx=c.pad_id)
        bd = c.bigram_dim or c.embed_dim
        self.bigram_embed = nn.Embedding(c.bigram_buckets, bd) if c.bigram_buckets > 0 else None
        self.bigram_proj = (nn.Linear(bd, c.embed_dim, bias=False)
                            if c.bigram_buckets > 0 and bd != c.embed_dim else None)
        register_pos_embed(self, c.pos_encoding, c.max_len, c.embed_dim)
        self.scale = math.sqrt(c.embed_dim) if c.embed_scale else 1.0
        self.pos_drop = nn.Dropout(c.drop_rate)
        dpr = torch.linspace(0, c.drop_path_rate, c.depth).tolist()
        self.blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.drop_rate,
                  c.attn_drop_rate, dpr[i])
            for i in range(c.depth)
        )
        self.norm = nn.LayerNorm(c.embed_dim, eps=LN_EPS)
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes else nn.Identity()
        self.ngram_head = (NgramHead(c.vocab_size, c.ngram_head_buckets, c.num_classes,
                                     c.ngram_head_order)
                           if c.ngram_head_buckets > 0 and c.num_classes else None)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # with embed_scale the embedding enters at std ~1, like the sinusoidal table
        std = 1.0 / self.scale if self.config.embed_scale else 0.02
        nn.init.normal_(self.tok_embed.weight, std=std)
        with torch.no_grad():
            self.tok_embed.weight[self.config.pad_id].zero_()
        if self.bigram_embed is not None:  # starts silent: the unigram model, then learns pairs
            nn.init.zeros_(self.bigram_embed.weight)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "tok_embed.weight", "bigram_embed.weight"}

    def bigram_ids(self, input_ids: Tensor) -> Tensor:
        """``(B, T)`` token ids -> ``(B, T)`` bucket of each (previous, current) pair; position 0
        pairs with ``[PAD]``. A multiplicative hash spreads the pairs over the buckets."""
        prev = F.pad(input_ids[:, :-1], (1, 0), value=self.config.pad_id)  # (B, T)
        return pair_buckets(prev, input_ids, self.config.bigram_buckets)  # (B, T)

    def reset_classifier(self, num_classes: int) -> None:
        c = self.config
        c.num_classes = num_classes
        self.head = nn.Linear(c.embed_dim, num_classes) if num_classes else nn.Identity()
        self.ngram_head = (NgramHead(c.vocab_size, c.ngram_head_buckets, num_classes,
                                     c.ngram_head_order)
                           if c.ngram_head_buckets > 0 and num_classes else None)

    def embed(self, input_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} > max_len {self.config.max_len}")
        x = self.tok_embed(input_ids)  # (B, T, D)
        if self.bigram_embed is not None:
            pairs = self.bigram_embed(self.bigram_ids(input_ids))  # (B, T, bigram_dim)
            x = x + (pairs if self.bigram_proj is None else self.bigram_proj(pairs))  # (B, T, D)
        x = x * self.scale
        return self.pos_drop(x + self.pos_embed[:, : input_ids.shape[1]])

    def forward_features(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, need_weights: bool = False,
        leaf_tokens: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """``input_ids`` ``(B, T)``; ``attention_mask`` ``(B, T)`` bool, True for real tokens
        (default: ``input_ids != pad_id``). Returns tokens ``(B, T, D)`` and, if asked, per-layer
        attention weights ``(B, H, T, T)`` (padded keys get exactly 0). ``leaf_tokens``: the
        autograd graph starts at the embedded tokens (parameters are never part of it)."""
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_id
        x = self.embed(input_ids)
        if leaf_tokens:
            x = x.detach().requires_grad_()
        attns: list[Tensor] = []
        for blk in self.blocks:
            x, w = blk(x, key_padding_mask=attention_mask, need_weights=need_weights)
            if w is not None:
                attns.append(w)
        return self.norm(x), (attns if need_weights else None)

    def forward_head(
        self, x: Tensor, attention_mask: Tensor | None = None, pre_logits: bool = False
    ) -> Tensor:
        if self.config.pool == "cls":
            pooled = x[:, 0]  # (B, D)
        else:
            if attention_mask is None:
                raise ValueError("mean pooling needs the attention mask")
            m = attention_mask[..., None].to(x.dtype)  # (B, T, 1)
            pooled = (x * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, D)
        pooled = self.head_drop(pooled)
        return pooled if pre_logits else self.head(pooled)

    def _logits(self, feats: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The Transformer's logits; in eval mode with an n-gram head, the mean of its logits
        and the head's (the normalised geometric mean of the two models' probabilities: the
        same argmax as their sum, better calibrated). Training leaves the head out: fitted on
        the same labelled texts, it would explain them away (train accuracy ~99 % from the
        first step) and the Transformer learn little from them, so the two are trained apart
        and pooled when evaluated and served."""
        logits = self.forward_head(feats, attention_mask)  # (B, K)
        if self.ngram_head is not None and not self.training:
            logits = (logits + self.ngram_head(input_ids, attention_mask)) / 2
        return logits

    def ngram_contributions(self, input_ids: Tensor, attention_mask: Tensor | None = None
                            ) -> Tensor | None:
        """``(B, T, K)``: each token's share of the served logits that comes from the n-gram
        head (half of :meth:`NgramHead.contributions`: the served logits are the mean of the
        two models'); None without a head. A token's shares are its n-grams' weights, so they
        read as "this word (with its neighbours) pushed the answer this way, this much"."""
        if self.ngram_head is None:
            return None
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_id
        return self.ngram_head.contributions(input_ids, attention_mask) / 2

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_id
        feats, _ = self.forward_features(input_ids, attention_mask)
        return self._logits(feats, input_ids, attention_mask)

    def attention_graph(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, track: bool = True
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits ``(B, K)`` and every layer's weights ``(B, H, T, T)``. ``track`` (under grad
        mode): the weights are in an autograd graph that starts at the tokens, which is what
        relevance differentiates."""
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_id
        feats, attns = self.forward_features(input_ids, attention_mask, need_weights=True,
                                             leaf_tokens=track)
        assert attns is not None
        return self._logits(feats, input_ids, attention_mask), attns

    def forward_with_attention(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logits ``(B, K)`` and attention ``(L, B, H, T, T)`` from one forward pass."""
        logits, attns = self.attention_graph(input_ids, attention_mask, track=False)
        return logits, stack_layers(attns)
