"""Shared models for the core tests."""

from __future__ import annotations

import pytest
import torch

from vit_service.data.tokenizer import TextTokenizer
from vit_service.models import create_model


@pytest.fixture
def crop_pair() -> tuple[TextTokenizer, torch.nn.Module, torch.nn.Module]:
    """A tokenizer over words ``w0``..``w59``, a text model reading 40 tokens whose
    Transformer reads the 10-token head+tail crop (``student_len``), and the same weights
    without the crop (``max_len`` 10), both in eval mode."""
    tok = TextTokenizer.train([" ".join(f"w{i}" for i in range(60))] * 20, vocab_size=150)
    torch.manual_seed(0)
    m = create_model("text_test", vocab_size=tok.vocab_size, max_len=40, student_len=10,
                     pad_id=tok.pad_id, pool="mean").eval()
    plain = create_model("text_test", vocab_size=tok.vocab_size, max_len=10,
                         pad_id=tok.pad_id, pool="mean").eval()
    plain.load_state_dict(m.state_dict())
    return tok, m, plain
