"""Masked-language-model pretraining for the text encoder (BERT-style, Devlin et al. 2019).

The encoder *is* a :class:`~vit_service.models.text.TextTransformer` (so after pretraining its
state dict loads straight into the sentiment classifier); an MLM head, tied to the token
embedding, predicts the original ids of the selected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit_service.models.layers import LN_EPS
from vit_service.models.text import TextConfig, TextTransformer

IGNORE = -100  # label of tokens that are not predicted


@dataclass
class MLMConfig:
    encoder: TextConfig = field(default_factory=TextConfig)  # the encoder being pretrained
    mask_prob: float = 0.15  # fraction of real (non-special) tokens selected for prediction
    replace_mask: float = 0.8  # of the selected: replaced by [MASK]
    replace_random: float = 0.1  # of the selected: replaced by a random token (rest: unchanged)


def mlm_mask(
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: tuple[int, ...] = (0, 1, 2, 3, 4),
    mask_prob: float = 0.15,
    replace_mask: float = 0.8,
    replace_random: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Select ``mask_prob`` of the real, non-special tokens; of those, ``replace_mask`` become
    ``[MASK]``, ``replace_random`` a random non-special token, the rest stay. Padding and special
    tokens are never selected. Returns ``(inputs, labels)``; labels are ``-100`` where unselected.
    """
    dev = input_ids.device
    eligible = attention_mask.clone()
    for s in special_ids:
        eligible &= input_ids != s
    u = torch.rand(input_ids.shape, device=dev, generator=generator)
    selected = eligible & (u < mask_prob)  # (B, T)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE))
    r = torch.rand(input_ids.shape, device=dev, generator=generator)
    to_mask = selected & (r < replace_mask)
    to_random = selected & (r >= replace_mask) & (r < replace_mask + replace_random)
    low = max(special_ids) + 1
    random_ids = torch.randint(low, vocab_size, input_ids.shape, device=dev, generator=generator)
    inputs = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


class MLM(nn.Module):
    def __init__(self, config: MLMConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = TextTransformer(config.encoder)
        d = config.encoder.embed_dim
        self.transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d, eps=LN_EPS))
        self.bias = nn.Parameter(torch.zeros(config.encoder.vocab_size))

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"bias"}

    def forward(
        self, inputs: Tensor, attention_mask: Tensor, labels: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Returns ``(loss, logits over the vocabulary for selected positions (M, V))``."""
        h, _ = self.encoder.forward_features(inputs, attention_mask)  # (B, T, D)
        sel = labels != IGNORE
        if not sel.any():  # nothing selected in this batch: a zero loss that keeps the graph
            return h.sum() * 0.0, h.new_zeros(0, self.config.encoder.vocab_size)
        h = self.transform(h[sel])  # (M, D): only selected positions, saves the big matmul
        logits = h @ self.encoder.tok_embed.weight.t() + self.bias  # (M, V), tied embedding
        return F.cross_entropy(logits, labels[sel]), logits
