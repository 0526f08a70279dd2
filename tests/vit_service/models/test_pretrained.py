"""Pretrained timm weights, offline: weights saved from a randomly initialised timm model."""

import pytest
import torch

from vit_service.models.pretrained import vit_from_timm

timm = pytest.importorskip("timm")


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000)
    path = tmp_path_factory.mktemp("w") / "vit_tiny_patch16_224.pth"
    torch.save(ref.state_dict(), path)
    return str(path), ref.state_dict()


def test_loads_timm_weights_with_a_new_grid_patch_and_head(timm_file: tuple[str, dict]) -> None:
    path, sd = timm_file
    m = vit_from_timm("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10, file=path)
    c = m.config
    assert (c.embed_dim, c.depth, c.num_heads) == (192, 12, 3)
    # transformer weights copied exactly
    torch.testing.assert_close(m.blocks[5].attn.qkv.weight, sd["blocks.5.attn.qkv.weight"])
    torch.testing.assert_close(m.norm.weight, sd["norm.weight"])
    torch.testing.assert_close(m.cls_token, sd["cls_token"])
    # positions resampled 14x14 -> 8x8, CLS position kept
    assert m.pos_embed.shape == (1, 65, 192)
    torch.testing.assert_close(m.pos_embed[:, 0], sd["pos_embed"][:, 0])
    # patch kernel resampled 16 -> 4: a constant image gives (nearly) the same patch embedding
    assert m.patch_embed.proj.weight.shape == (192, 3, 4, 4)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    ref.load_state_dict(sd)
    flat = torch.full((1, 3, 16, 16), 0.5)
    old = ref.patch_embed.proj(flat).flatten()
    new = m.patch_embed.proj(flat[..., :4, :4]).flatten()
    assert torch.nn.functional.cosine_similarity(old, new, dim=0) > 0.9
    # new head: right size, logits computable
    assert m.head.out_features == 10
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_missing_weights_give_a_clear_error(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="init.timm_file"):
        vit_from_timm("vit_tiny_patch16_224", file=tmp_path / "nope.pth")
