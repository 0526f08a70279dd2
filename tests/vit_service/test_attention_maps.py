import io

import numpy as np
import pytest
import torch
from PIL import Image

from vit_service.attention_maps import (
    attention_rollout,
    compute_attention_maps,
    fuse_heads,
    head_maps,
    layer_maps,
    overlay_heatmap,
    png_bytes,
    rollout_matrix,
)
from vit_service.models import create_model


def _random_attn(L: int = 3, B: int = 2, H: int = 4, T: int = 17, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, B, H, T, T, generator=g).mul(2).softmax(-1)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_joint_rollout_rows_sum_to_one(fusion: str) -> None:
    joint = rollout_matrix(_random_attn(), head_fusion=fusion)
    assert joint.shape == (2, 17, 17)
    torch.testing.assert_close(joint.sum(-1), torch.ones(2, 17))
    assert (joint >= 0).all()


def test_rollout_matches_the_abnar_zuidema_formula() -> None:
    attn = _random_attn(L=3, B=1, H=2, T=5)
    w = attn.mean(2)[:, 0]  # (L, T, T), mean-fused heads
    eye = torch.eye(5)
    joint = eye
    for layer in w:
        joint = (0.5 * layer + 0.5 * eye) @ joint  # W rows sum to 1, so (W + I)/2 is stochastic
    cls = joint[0, 1:] / joint[0, 1:].sum()
    torch.testing.assert_close(attention_rollout(attn)[0], cls)


@pytest.mark.parametrize("fusion", ["mean", "max"])
@pytest.mark.parametrize("query", ["cls", "mean"])
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_row_equals_the_row_of_the_joint_matrix(fusion: str, query: str,
                                                        residual: bool) -> None:
    from vit_service.attention_maps import normalise_rows, query_row

    attn = _random_attn(L=4, B=3, H=2, T=7, seed=1)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 6 + [0]], dtype=torch.bool)
    joint = rollout_matrix(attn, head_fusion=fusion, residual=residual)  # (B, T, T)
    want = normalise_rows(query_row(joint, query, mask, 1)[:, 1:], mask, 1, 0)
    got = attention_rollout(attn, fusion, mask, residual=residual, query=query)
    torch.testing.assert_close(got, want)
    maps = compute_attention_maps(attn, mask, head_fusion=fusion, query=query)
    if residual:
        torch.testing.assert_close(maps.rollout, want)
    torch.testing.assert_close(maps.layers, layer_maps(attn, mask, query=query))


def test_single_layer_rollout_equals_the_layer_map() -> None:
    # with one layer, 0.5 W + 0.5 I only changes the CLS->CLS entry, which is dropped
    attn = _random_attn(L=1)
    torch.testing.assert_close(attention_rollout(attn), layer_maps(attn)[:, 0])


def test_uniform_attention_gives_a_uniform_map() -> None:
    attn = torch.full((2, 1, 3, 17, 17), 1 / 17)
    torch.testing.assert_close(attention_rollout(attn, grid=(4, 4)), torch.full((1, 4, 4), 1 / 16))


def test_cls_attending_only_to_itself_gives_zeros_not_nan() -> None:
    attn = torch.eye(5).expand(2, 1, 2, 5, 5).clone()
    out = attention_rollout(attn)
    assert torch.equal(out, torch.zeros(1, 4))


def test_head_fusions_and_unknown_fusion() -> None:
    attn = _random_attn()
    assert torch.equal(fuse_heads(attn, "max"), attn.amax(2))
    assert torch.equal(fuse_heads(attn, "min"), attn.amin(2))
    maps = {f: attention_rollout(attn, head_fusion=f) for f in ("mean", "max", "min")}
    for m in maps.values():
        torch.testing.assert_close(m.sum(-1), torch.ones(2))
    assert not torch.allclose(maps["max"], maps["min"])
    with pytest.raises(ValueError, match="unknown head fusion"):
        fuse_heads(attn, "median")  # type: ignore[arg-type]


def test_vit_maps_have_grid_shapes_and_sum_to_one() -> None:
    torch.manual_seed(0)
    model = create_model("vit_test").eval()  # 32x32, patch 8 -> 4x4 grid, 2 layers, 2 heads
    with torch.no_grad():
        _, attn = model.forward_with_attention(torch.randn(3, 3, 32, 32))
    assert attn.shape == (2, 3, 2, 17, 17)
    maps = compute_attention_maps(attn, grid=(4, 4), with_heads=True)
    assert maps.rollout.shape == (3, 4, 4)
    assert maps.layers.shape == (3, 2, 4, 4)
    assert maps.heads is not None and maps.heads.shape == (3, 2, 2, 4, 4)
    torch.testing.assert_close(maps.rollout.sum((-2, -1)), torch.ones(3))
    torch.testing.assert_close(maps.layers.sum((-2, -1)), torch.ones(3, 2))
    torch.testing.assert_close(maps.heads.sum((-2, -1)), torch.ones(3, 2, 2))
    # row-major patch order: grid cell (r, c) is token 1 + r * 4 + c
    flat = attention_rollout(attn)
    torch.testing.assert_close(flat.view(3, 4, 4), maps.rollout)
    # a single item (L, H, T, T) works too
    torch.testing.assert_close(attention_rollout(attn[:, 1]), flat[1:2])
    assert compute_attention_maps(attn).heads is None


def test_text_padding_is_excluded_and_does_not_change_the_map() -> None:
    torch.manual_seed(0)
    model = create_model("text_test").eval()
    ids = torch.tensor([[2, 17, 45, 99, 8, 0, 0, 0]])  # [CLS] + 4 tokens + 3 pads (pad_id 0)
    mask = ids != 0
    with torch.no_grad():
        _, attn = model.forward_with_attention(ids, mask)
        _, attn_short = model.forward_with_attention(ids[:, :5], mask[:, :5])
    roll = attention_rollout(attn, attention_mask=mask)
    assert roll.shape == (1, 7)
    assert torch.equal(roll[0, 4:], torch.zeros(3))  # padded positions exactly 0
    torch.testing.assert_close(roll.sum(), torch.tensor(1.0))
    torch.testing.assert_close(roll[0, :4], attention_rollout(attn_short)[0], atol=1e-6, rtol=0)
    lay = layer_maps(attn, attention_mask=mask)
    hd = head_maps(attn, attention_mask=mask)
    assert lay.shape == (1, 2, 7) and hd.shape == (1, 2, 2, 7)
    assert torch.equal(lay[..., 4:], torch.zeros(1, 2, 3))
    assert torch.equal(hd[..., 4:], torch.zeros(1, 2, 2, 3))
    torch.testing.assert_close(lay.sum(-1), torch.ones(1, 2))
    torch.testing.assert_close(hd.sum(-1), torch.ones(1, 2, 2))


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="expected attention"):
        attention_rollout(torch.rand(3, 5, 5))
    with pytest.raises(ValueError, match="grid"):
        attention_rollout(_random_attn(T=17), grid=(3, 3))


@pytest.mark.parametrize(("size", "expected"), [((32, 32), (224, 224)), ((1000, 500), (512, 256))])
def test_overlay_is_a_png_of_bounded_size(size: tuple[int, int], expected: tuple[int, int]) -> None:
    img = Image.new("L", size, 128)  # any mode is converted to RGB
    heat = np.arange(16, dtype=np.float32).reshape(4, 4)
    png = overlay_heatmap(img, heat)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    out = Image.open(io.BytesIO(png))
    assert out.size == expected and out.mode == "RGB"
    # the hottest cell (bottom-right) is coloured differently from the coldest (top-left)
    px = np.asarray(out, dtype=int)
    assert np.abs(px[-5, -5] - px[4, 4]).sum() > 100
    # a constant map does not divide by zero
    Image.open(io.BytesIO(overlay_heatmap(img, torch.zeros(4, 4)))).load()


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (224, 224)])
def test_png_bytes_decode_to_exactly_the_pixels(shape: tuple[int, int]) -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    out = Image.open(io.BytesIO(png_bytes(rgb)))
    assert out.mode == "RGB" and out.size == (shape[1], shape[0])
    assert np.array_equal(np.asarray(out), rgb)
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(rgb.astype(np.float32))


def test_colormap_lut_matches_matplotlib_to_a_quantisation_step() -> None:
    from matplotlib import colormaps

    from vit_service.attention_maps import _colormap

    v = np.random.default_rng(0).random((50, 40))
    exact = colormaps["inferno"](v)[..., :3] * 255
    got = _colormap(v, "inferno").astype(float)
    assert got.shape == (50, 40, 3)
    assert np.abs(got - exact).max() <= 6  # one of 256 levels apart at most
    assert np.array_equal(_colormap(np.array([[0.0, 1.0]]), "inferno")[0],
                          (colormaps["inferno"]([0.0, 1.0])[:, :3] * 255).round())


def test_mean_query_reads_the_mean_of_the_token_rows() -> None:
    from vit_service.attention_maps import head_maps, layer_maps, query_row

    torch.manual_seed(0)
    attn = torch.rand(2, 3, 2, 5, 5).softmax(-1)  # (L, B, H, T, T)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    rows = query_row(attn.transpose(0, 1), "mean", mask, 1)  # (B, L, H, T)
    want = attn[:, 1, :, 1:3, :].mean(-2)  # item 1: the mean of its two real token rows
    assert torch.allclose(rows[1], want)  # (L, H, T)
    lm = layer_maps(attn, attention_mask=mask, query="mean")  # (B, L, N)
    hm = head_maps(attn, attention_mask=mask, query="mean")  # (B, L, H, N)
    ro = attention_rollout(attn, attention_mask=mask, query="mean")  # (B, N)
    for m in (lm, hm, ro):
        assert torch.allclose(m.sum(-1), torch.ones(m.shape[:-1]), atol=1e-6)
        assert (m[1, ..., 2:] == 0).all()  # padding gets exactly 0
    # with one query token the mean row is that token's row, not [CLS]'s
    one = attention_rollout(attn[:, :1, :, :2, :2], query="mean")
    cls = attention_rollout(attn[:, :1, :, :2, :2], query="cls")
    assert one.shape == cls.shape == (1, 1)
    assert not torch.allclose(layer_maps(attn, query="mean"), layer_maps(attn, query="cls"))
