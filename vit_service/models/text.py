"""Transformer encoder for sentiment classification (text -> label).

Token embedding (with a padding index) -> positional encoding -> pre-norm blocks with a
key-padding mask -> final norm -> pooling (the ``[CLS]`` token or a masked mean) -> head.
Padding never influences real tokens: appending padding leaves the logits unchanged (tested).

With ``ngram_head_buckets`` the module also holds an n-gram head
(:mod:`vit_service.models.ngram_heads`: tokens and token pairs, or words and word pairs), a
linear model fitted by the training run before the Transformer trains
(``training/ngram_teacher.py``) and never updated by the optimiser; in eval mode (validation,
serving) the logits are the mean of the Transformer's and the head's. With ``student_len`` the
Transformer reads a head+tail crop of the input (the one ``truncation: head_tail`` would have
cut at that length) and the head all of it; attention weights are the crop's, and
:meth:`TextTransformer.read_tokens` says where its tokens sit in the input (maps are computed
over the crop and placed there: ``vit_service.pipeline.ReadTokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit_service.data.tokenizer import head_tail_cut
from vit_service.models.layers import LN_EPS, Block, stack_layers
from vit_service.models.ngram_heads import (
    NgramHead,
    NgramHeads,
    WordNgramHead,
    check_ngram_head,
    pair_buckets,
)
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
    ngram_head_unit: Literal["token", "word"] = "token"  # the head's n-grams: of WordPiece
    # tokens, or of words formed from them (a piece and its ## pieces; uni+bigrams, order 2):
    # the NB-LR teacher's features, which gain more than tokens when the head reads further
    student_len: int = 0  # >0: the Transformer reads the head+tail crop of this many of the
    # input's tokens ([CLS] included) and the n-gram head all max_len of them (its cost hardly
    # grows with length, the Transformer's does); 0: both read the whole input

    @property
    def encoder_len(self) -> int:
        """The longest sequence the Transformer reads: its crop, at most the whole input."""
        return min(self.student_len, self.max_len) if self.student_len else self.max_len

    def __post_init__(self) -> None:  # a job's bad override is refused before it runs
        check_ngram_head(self.ngram_head_buckets, self.ngram_head_order)
        if self.ngram_head_unit not in ("token", "word"):
            raise ValueError(f"ngram_head_unit must be token or word, got "
                             f"{self.ngram_head_unit!r}")
        if self.ngram_head_unit == "word" and self.ngram_head_order != 2:
            raise ValueError("a word n-gram head takes words and word pairs: "
                             "ngram_head_order must be 2")
        if self.student_len and self.student_len < 2:  # [CLS] and one token at least
            raise ValueError(f"student_len must be 0 (off) or >= 2, got {self.student_len}")


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
        register_pos_embed(self, c.pos_encoding, c.encoder_len, c.embed_dim)
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
        self.ngram_head = make_ngram_head(c)
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
        self.ngram_head = make_ngram_head(c)

    def embed(self, input_ids: Tensor) -> Tensor:
        T, c = input_ids.shape[1], self.config
        if T > c.encoder_len:
            raise ValueError(f"sequence length {T} > max_len {c.max_len}" if not c.student_len
                             else f"the Transformer reads {T} tokens > student_len "
                             f"{c.student_len} (crop with student_view)")
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

    def student_view(self, input_ids: Tensor, attention_mask: Tensor, width: int | None = None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the Transformer reads: ``(ids, mask, positions)`` of the head+tail crop of
        ``student_len`` tokens (``positions`` ``(B, S)``: each one's index in the input; None
        when there is no crop to make). A row's length is its count of non-``[PAD]`` ids, not of
        its mask, so a token masked out (faithfulness, token dropout) moves no other. Shorter
        rows keep every token; past the crop, positions are padding (mask False). ``width``:
        make the view that wide whatever the input's length (what a trace recorded on a long
        input reads from a short one: slots past the input are padding)."""
        S, T = width or self.config.student_len, input_ids.shape[1]
        if not S or (width is None and T <= S):
            return input_ids, attention_mask, None
        n = (input_ids != self.config.pad_id).sum(1, keepdim=True)  # (B, 1) [CLS] included
        head, _ = head_tail_cut(S, S - 1)  # pieces kept from the start (the tokenizer's rule)
        j = torch.arange(S, device=input_ids.device).unsqueeze(0)  # (1, S)
        # a long row: [CLS], its first `head` pieces, then its last S - 1 - head
        long_pos = torch.where(j <= head, j, n - S + j)  # (B, S)
        pos = torch.where(n > S, long_pos, j.expand_as(long_pos))  # (B, S)
        inside = j < n  # (B, S)
        pos = pos.clamp(0, T - 1)
        ids = input_ids.gather(1, pos).masked_fill(~inside, self.config.pad_id)  # (B, S)
        return ids, attention_mask.gather(1, pos) & inside, pos

    def read_tokens(self, input_ids: Tensor, attention_mask: Tensor, width: int | None = None
                    ) -> tuple[Tensor, Tensor | None]:
        """The tokens the Transformer's attention read: their mask ``(B, W)`` and their
        positions in the input ``(B, W)`` (None: the input's own, no crop). ``width``: that of
        the attention weights at hand (a trace's may be wider than the eager model's); default
        the model's own view."""
        if width == input_ids.shape[1]:
            return attention_mask, None  # the whole input, as it is
        _, mask, pos = self.student_view(input_ids, attention_mask, width)
        return mask, pos

    def _logits(self, feats: Tensor, student_mask: Tensor, input_ids: Tensor,
                attention_mask: Tensor) -> Tensor:
        """The Transformer's logits; in eval mode with an n-gram head, the mean of its logits
        and the head's (the normalised geometric mean of the two models' probabilities: the
        same argmax as their sum, better calibrated). Training leaves the head out: fitted on
        the same labelled texts, it would explain them away (train accuracy ~99 % from the
        first step) and the Transformer learn little from them, so the two are trained apart
        and pooled when evaluated and served."""
        logits = self.forward_head(feats, student_mask)  # (B, K)
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
        ids, mask, _ = self.student_view(input_ids, attention_mask)
        feats, _ = self.forward_features(ids, mask)
        return self._logits(feats, mask, input_ids, attention_mask)

    def attention_graph(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, track: bool = True
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits ``(B, K)`` and every layer's weights ``(B, H, T, T)`` (with ``student_len``:
        ``(B, H, S, S)`` over the crop, see :meth:`read_tokens`). ``track`` (under grad
        mode): the weights are in an autograd graph that starts at the tokens, which is what
        relevance differentiates."""
        if attention_mask is None:
            attention_mask = input_ids != self.config.pad_id
        ids, mask, _ = self.student_view(input_ids, attention_mask)
        feats, attns = self.forward_features(ids, mask, need_weights=True, leaf_tokens=track)
        assert attns is not None
        return self._logits(feats, mask, input_ids, attention_mask), attns

    def forward_with_attention(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logits ``(B, K)`` and attention ``(L, B, H, T, T)`` from one forward pass (over the
        crop with ``student_len``: see :meth:`read_tokens`)."""
        logits, attns = self.attention_graph(input_ids, attention_mask, track=False)
        return logits, stack_layers(attns)


def make_ngram_head(c: TextConfig) -> NgramHeads | None:
    """The n-gram head ``c`` asks for (None: no buckets, or no classes to score)."""
    if c.ngram_head_buckets <= 0 or not c.num_classes:
        return None
    if c.ngram_head_unit == "word":
        return WordNgramHead(c.vocab_size, c.ngram_head_buckets, c.num_classes)
    return NgramHead(c.vocab_size, c.ngram_head_buckets, c.num_classes, c.ngram_head_order)
