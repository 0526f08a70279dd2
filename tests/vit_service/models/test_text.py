import pytest
import torch

from vit_service.models import create_model


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
@pytest.mark.parametrize("fused", [True, False])
def test_appending_padding_does_not_change_logits(pool: str, pos: str, fused: bool) -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool=pool, pos_encoding=pos).eval()
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
    ids = torch.randint(5, 1000, (3, 20))
    ids[:, 0] = 2  # [CLS]
    padded = torch.cat([ids, torch.zeros(3, 25, dtype=torch.long)], dim=1)  # 25 [PAD]s
    with torch.no_grad():
        torch.testing.assert_close(m(padded), m(ids), atol=1e-5, rtol=0)


def test_batch_with_different_lengths_equals_one_by_one() -> None:
    torch.manual_seed(0)
    m = create_model("text_test", pool="mean").eval()
    a = torch.randint(5, 1000, (1, 30))
    b = torch.randint(5, 1000, (1, 11))
    batch = torch.zeros(2, 30, dtype=torch.long)
    batch[0] = a
    batch[1, :11] = b
    with torch.no_grad():
        out = m(batch)
        torch.testing.assert_close(out[0], m(a)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], m(b)[0], atol=1e-5, rtol=0)


def test_padding_embedding_is_zero_and_padded_keys_get_no_attention() -> None:
    m = create_model("text_test").eval()
    assert torch.all(m.tok_embed.weight[0] == 0)
    ids = torch.tensor([[2, 10, 11, 12, 0, 0]])
    _, attn = m.forward_with_attention(ids)
    assert attn.shape == (2, 1, 2, 6, 6)
    assert torch.all(attn[..., 4:] == 0)


def test_too_long_input_is_rejected() -> None:
    m = create_model("text_test")
    with pytest.raises(ValueError, match="max_len"):
        m(torch.ones(1, 65, dtype=torch.long))
