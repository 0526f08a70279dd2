import pytest
import torch

from vit_service.models.layers import Attention, Block, DropPath

torch.manual_seed(0)


def _attn(dim: int = 32, heads: int = 4) -> Attention:
    torch.manual_seed(0)
    return Attention(dim, heads).eval()


def _padding_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) True = real


def test_rows_sum_to_one() -> None:
    x = torch.randn(3, 7, 32)
    _, w = _attn()(x, need_weights=True)
    assert w.shape == (3, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 7))


def test_padded_keys_get_exactly_zero_weight() -> None:
    x = torch.randn(3, 9, 32)
    mask = _padding_mask([9, 5, 2], 9)
    _, w = _attn()(x, key_padding_mask=mask, need_weights=True)
    for b, n in enumerate([9, 5, 2]):
        assert torch.all(w[b, :, :, n:] == 0)
        assert torch.all(w[b, :, :, :n] > 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 9))


def test_causal_mask_zeroes_the_future() -> None:
    x = torch.randn(2, 6, 32)
    _, w = _attn()(x, causal=True, need_weights=True)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert torch.all(w[..., future] == 0)
    assert torch.all(w[..., ~future] > 0)
    # the first query can only see itself
    torch.testing.assert_close(w[..., 0, 0], torch.ones(2, 4))


def test_causal_output_ignores_future_tokens() -> None:
    attn = _attn()
    x = torch.randn(1, 6, 32)
    y = x.clone()
    y[:, 4:] = torch.randn(1, 2, 32)  # change only the future of position 3
    out_x, _ = attn(x, causal=True)
    out_y, _ = attn(y, causal=True)
    torch.testing.assert_close(out_x[:, :4], out_y[:, :4], atol=1e-6, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "both"])
def test_fused_and_explicit_paths_agree(mask_kind: str) -> None:
    attn = _attn()
    x = torch.randn(4, 10, 32)
    mask = _padding_mask([10, 7, 3, 1], 10) if mask_kind in ("padding", "both") else None
    causal = mask_kind in ("causal", "both")
    attn.fused_attn = True
    fused, w_none = attn(x, key_padding_mask=mask, causal=causal)
    assert w_none is None
    attn.fused_attn = False
    explicit, w = attn(x, key_padding_mask=mask, causal=causal)
    assert w is not None
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    # need_weights forces the explicit path even when fused is on
    attn.fused_attn = True
    forced, w2 = attn(x, key_padding_mask=mask, causal=causal, need_weights=True)
    torch.testing.assert_close(forced, explicit, atol=0, rtol=0)
    torch.testing.assert_close(w2, w)


@pytest.mark.parametrize("fused", [True, False])
def test_fully_masked_row_gives_no_nan(fused: bool) -> None:
    attn = _attn()
    attn.fused_attn = fused
    x = torch.randn(2, 5, 32, requires_grad=True)
    mask = _padding_mask([5, 0], 5)  # second sample is all padding
    out, w = attn(x, key_padding_mask=mask, need_weights=not fused)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    if w is not None:
        assert torch.isfinite(w).all()
        assert torch.all(w[1] == 0)


def test_block_is_permutation_equivariant_without_positions() -> None:
    torch.manual_seed(0)
    blk = Block(32, 4).eval()
    x = torch.randn(2, 8, 32)
    perm = torch.randperm(8)
    out, _ = blk(x)
    out_p, _ = blk(x[:, perm])
    torch.testing.assert_close(out[:, perm], out_p, atol=1e-5, rtol=0)


def test_drop_path_scales_and_drops_whole_samples() -> None:
    torch.manual_seed(0)
    dp = DropPath(0.5).train()
    x = torch.ones(1000, 3, 4)
    y = dp(x)
    per_sample = y.reshape(1000, -1)
    # each sample is either all zero or all 1/keep
    assert set(per_sample.unique().tolist()) <= {0.0, 2.0}
    assert torch.all(per_sample.min(1).values == per_sample.max(1).values)
    assert 0.4 < (per_sample[:, 0] == 0).float().mean() < 0.6
    assert torch.equal(dp.eval()(x), x)
