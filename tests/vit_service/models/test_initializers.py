import pytest
import torch

from vit_service.models import create_model
from vit_service.models.initializers import (
    extract_patches,
    first_conv,
    mimetic_init_,
    whiten_patch_embed_,
)


def _images(n: int = 256, seed: int = 0) -> torch.Tensor:
    """Correlated 'natural-ish' images: smooth noise plus a colour cast, normalised-ish."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(n, 3, 8, 8, generator=g)
    x = torch.nn.functional.interpolate(low, size=32, mode="bilinear", align_corners=False)
    return x + 0.3 * torch.randn(n, 3, 32, 32, generator=g) + torch.tensor([0.5, -0.2, 0.1])[
        None, :, None, None]


def _channel_cov(model: torch.nn.Module, images: torch.Tensor, channels: int) -> torch.Tensor:
    conv = first_conv(model)
    with torch.no_grad():
        y = conv(images)[:, :channels]  # (B, c, h, w)
    feats = y.permute(0, 2, 3, 1).reshape(-1, channels)
    return torch.cov(feats.T)


def test_whitening_makes_patch_features_white_on_training_patches() -> None:
    model = create_model("vit_nano_patch4_32")
    x = _images()
    before = _channel_cov(model, x, 48)
    info = whiten_patch_embed_(model, x, eps=1e-6)
    assert info.directions == 48 and not info.signed  # 4*4*3 patch dims, linear embedding
    cov = _channel_cov(model, x, 48)
    assert torch.allclose(cov, torch.eye(48), atol=2e-2), (cov - torch.eye(48)).abs().max()
    assert not torch.allclose(before, torch.eye(48), atol=0.1)  # it was not white before
    with torch.no_grad():  # the whitened outputs are centred (bias)
        y = first_conv(model)(x)[:, :48]
    assert y.mean(dim=(0, 2, 3)).abs().max() < 1e-3


def test_whitening_the_conv_stem_writes_signed_pairs() -> None:
    model = create_model("vit_nano_patch4_32", stem="conv")
    x = _images()
    info = whiten_patch_embed_(model, x, eps=1e-6)
    assert info.signed and info.directions == 16  # 32 filters: 16 directions, +v and -v
    w = first_conv(model).weight
    assert torch.allclose(w[:16], -w[16:32])
    # the positive half is white on the training windows (3x3, padding 1)
    feats = extract_patches(x, 3, 1, 1) @ w[:16].flatten(1).T
    cov = torch.cov(feats.T)
    assert torch.allclose(cov, torch.eye(16), atol=2e-2)


def test_mimetic_products_follow_the_stated_form() -> None:
    model = create_model("vit_test")  # 2 blocks, dim 32, 2 heads
    g = torch.Generator().manual_seed(0)
    assert mimetic_init_(model, alpha1=0.0, beta1=0.7, alpha2=0.0, beta2=0.4, generator=g) == 2
    for blk in model.blocks:
        attn = blk.attn
        D, dh = attn.qkv.in_features, attn.head_dim
        w = attn.qkv.weight
        wq, wk, wv = w[:D], w[D : 2 * D], w[2 * D :]
        # values then output projection: exactly -beta2 * I
        assert torch.allclose(wv.T @ attn.proj.weight.T, -0.4 * torch.eye(D), atol=1e-5)
        for h in range(attn.num_heads):
            sl = slice(h * dh, (h + 1) * dh)
            p = wq[sl].T @ wk[sl] / 0.7  # rank-dh truncation of I: an orthogonal projection
            assert torch.allclose(p @ p, p, atol=1e-4)
            assert torch.trace(p).item() == pytest.approx(dh, abs=1e-3)
        assert attn.qkv.bias.abs().max() == 0 and attn.proj.bias.abs().max() == 0


def test_mimetic_with_noise_stays_close_to_identity() -> None:
    model = create_model("vit_nano_patch4_32")
    mimetic_init_(model, generator=torch.Generator().manual_seed(1))
    attn = model.blocks[0].attn
    D = attn.qkv.in_features
    w = attn.qkv.weight
    w = w.detach()
    qk = w[:D].T @ w[D : 2 * D]  # sum over heads of Wq_h^T Wk_h
    vo = w[2 * D :].T @ attn.proj.weight.detach().T
    eye = torch.eye(D)
    cos = lambda a, b: float((a * b).sum() / (a.norm() * b.norm()))  # noqa: E731
    assert cos(qk, eye) > 0.5 and cos(vo, -eye) > 0.5
    x = torch.randn(4, 3, 32, 32)
    assert torch.isfinite(model(x)).all()
