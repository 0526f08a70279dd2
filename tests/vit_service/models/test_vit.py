import pytest
import torch

from vit_service.models import create_model, get_config, set_fused_attn
from vit_service.models.vit import ConvStem, ViT, ViTConfig

timm = pytest.importorskip("timm")


def _timm_twin(name: str) -> torch.nn.Module:
    c = get_config(name)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=c.img_size, patch_size=c.patch_size, in_chans=c.in_chans,
        num_classes=c.num_classes, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
        mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, global_pool="token", class_token=True,
    )


@pytest.mark.parametrize("name", ["vit_test", "vit_nano_patch4_32", "vit_tiny_patch4_32"])
def test_timm_state_dict_loads_and_logits_match(name: str) -> None:
    torch.manual_seed(0)
    ref = _timm_twin(name).eval()
    # randomise every tensor so that a wrong mapping cannot hide behind zeros or ones
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    ours = create_model(name).eval()
    theirs = ref.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in theirs.items()
    }
    ours.load_state_dict(theirs, strict=True)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        expected = ref(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        set_fused_attn(ours, False)  # explicit path too
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


def test_patch_embedding_is_a_strided_conv_giving_64_patches() -> None:
    m = create_model("vit_tiny_patch4_32")
    conv = m.patch_embed.proj
    assert isinstance(conv, torch.nn.Conv2d)
    assert conv.kernel_size == conv.stride == (4, 4)
    tokens = m.embed(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 65, 192)  # CLS + 8x8 patches


def test_attention_comes_from_the_same_pass_as_the_logits() -> None:
    torch.manual_seed(0)
    m = create_model("vit_test").eval()
    x = torch.randn(3, 3, 32, 32)
    logits, attn = m.forward_with_attention(x)
    assert attn.shape == (2, 3, 2, 17, 17)  # (L, B, H, T, T)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 3, 2, 17))
    torch.testing.assert_close(logits, m(x), atol=1e-5, rtol=0)


def test_reset_classifier_replaces_the_head() -> None:
    m = create_model("vit_test")
    m.reset_classifier(100)
    assert m.head.out_features == 100 and m.config.num_classes == 100
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 100)


def test_flip_tta_logits_are_the_mean_of_the_two_views() -> None:
    from vit_service.tta import predict, predict_with_attention

    torch.manual_seed(0)
    model = create_model("vit_test", tta_flip=True).eval()
    x = torch.randn(3, 3, 32, 32)
    plain = create_model("vit_test").eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = (plain(x) + plain(x.flip(-1))) / 2
        got = predict(model, x)
        logits, attn = predict_with_attention(model, x)
        _, attn_plain = plain.forward_with_attention(x)
        own = model(x)  # the model itself answers for the image as given
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(logits, expected, atol=1e-5)
    assert torch.allclose(attn, attn_plain, atol=1e-6)  # maps of the image as given
    assert torch.equal(own, plain(x))
    model.train()  # training: one view, no averaging
    assert torch.allclose(predict(model, x), plain.train()(x), atol=1e-5)


def test_mean_pooling_reads_the_patch_tokens_not_cls() -> None:
    torch.manual_seed(0)
    model = create_model("vit_test", pool="mean").eval()
    x = torch.randn(2, 3, 32, 32)
    feats, _ = model.forward_features(x)
    assert torch.allclose(model.forward_head(feats, pre_logits=True), feats[:, 1:].mean(1))
    with torch.no_grad():
        model.cls_token.add_(5.0)  # CLS only reaches the output through attention
        feats2, _ = model.forward_features(x)
    assert not torch.allclose(feats2[:, 0], feats[:, 0])


def test_conv_stem_gives_the_same_token_grid() -> None:
    model = create_model("vit_nano_patch4_32", stem="conv")
    tokens = model.patch_embed(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 64, 128)  # (B, N, D)
    convs = [m for m in model.patch_embed.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride[0] for c in convs] == [1, 2, 2]  # 32 -> 16 -> 8
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_deeper_conv_stem_adds_stride_1_convs_at_every_resolution() -> None:
    model = create_model("vit_nano_patch4_32", stem="conv", stem_width=8, stem_depth=2)
    convs = [m for m in model.patch_embed.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride[0] for c in convs] == [1, 1, 2, 1, 2, 1]  # two convs at 32, 16 and 8 px
    assert [c.out_channels for c in convs] == [8, 8, 16, 16, 32, 32]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="at least one conv"):
        ConvStem(4, 3, 128, 8, depth=0)
    for field in ("stem_depth", "stem_width"):  # refused with the config, before any build
        with pytest.raises(ValueError, match=f"{field} must be > 0"):
            create_model("vit_nano_patch4_32", stem="conv", **{field: 0})


def test_stem_full_depth_sets_the_convs_at_full_resolution_only() -> None:
    model = create_model("vit_nano_patch4_32", stem="conv", stem_width=8, stem_depth=2,
                         stem_full_depth=1)
    convs = [m for m in model.patch_embed.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride[0] for c in convs] == [1, 2, 1, 2, 1]  # one conv at 32 px, two at 16 and 8
    assert [c.out_channels for c in convs] == [8, 16, 16, 32, 32]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    deep = create_model("vit_nano_patch4_32", stem="conv", stem_width=8, stem_full_depth=3)
    assert [c.stride[0] for c in deep.patch_embed.stem if isinstance(c, torch.nn.Conv2d)] == [
        1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="stem_full_depth must be > 0"):
        create_model("vit_nano_patch4_32", stem="conv", stem_full_depth=0)


def test_conv_stem_runs_its_convolutions_channels_last_with_the_same_values() -> None:
    torch.manual_seed(0)
    model = create_model("vit_nano_patch4_32", stem="conv").eval()
    stem = model.patch_embed
    layouts = []
    for m in stem.stem:
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_pre_hook(lambda _m, args: layouts.append(
                args[0].is_contiguous(memory_format=torch.channels_last)))
    x = torch.randn(2, 3, 32, 32)  # NCHW, as the data pipeline and the server give it
    with torch.no_grad():
        tokens = stem(x)
        ref = stem.proj(_nchw_stem(stem, x))  # (B, D, 8, 8)
    assert layouts[:3] == [True, True, True]
    assert tokens.shape == (2, 64, 128)
    assert torch.allclose(tokens, ref.flatten(2).transpose(1, 2), atol=1e-5)


def _nchw_stem(stem: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The stem's layers run one by one on a contiguous (NCHW) tensor: the reference."""
    for m in stem.stem:
        x = m(x.contiguous())
    return x.contiguous()


def test_patch_dropout_keeps_a_random_share_in_training_only() -> None:
    torch.manual_seed(0)
    m = ViT(ViTConfig(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                      patch_dropout=0.25, pool="mean"))
    x = torch.randn(3, 3, 16, 16)
    tokens = m.embed(x)  # (3, 17, 16)
    kept = m._drop_patches(tokens)
    assert kept.shape == (3, 1 + 12, 16)
    assert torch.equal(kept[:, 0], tokens[:, 0])  # [CLS] always stays
    for b in range(3):  # every kept token is one of the image's own, none twice
        rows = {tuple(r.tolist()) for r in tokens[b, 1:]}
        got = [tuple(r.tolist()) for r in kept[b, 1:]]
        assert set(got) <= rows and len(set(got)) == 12
    m.train()
    feats, _ = m.forward_features(x)
    assert feats.shape[1] == 13
    m.eval()
    feats, _ = m.forward_features(x)
    assert feats.shape[1] == 17  # evaluation and serving see every patch
    plain = ViT(ViTConfig(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                          pool="mean")).eval()
    plain.load_state_dict(m.state_dict())
    assert torch.allclose(plain(x), m(x))


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_a_smaller_image_gets_a_smaller_grid_with_matching_positions(pos: str) -> None:
    from vit_service.models.pos_encoding import resample_grid_pos_embed, sinusoidal_table_2d

    torch.manual_seed(0)
    m = create_model("vit_test", pos_encoding=pos, img_size=32, patch_size=4)
    assert m.pos_embed_for((8, 8)) is m.pos_embed  # the full grid: the model's own table
    small = m.pos_embed_for((4, 4))  # (1, 1 + 16, D)
    D = m.config.embed_dim
    assert small.shape == (1, 17, D)
    if pos == "sinusoidal":
        expect = sinusoidal_table_2d(4, 4, D, stride=(2.0, 2.0))
        torch.testing.assert_close(small[0, 1:], expect)
        assert small[0, 0].abs().max() == 0  # CLS keeps a zero position
    else:
        torch.testing.assert_close(small, resample_grid_pos_embed(m.pos_embed, (4, 4)))
    m.train()
    x = torch.randn(2, 3, 16, 16)
    logits = m(x)
    assert logits.shape == (2, m.config.num_classes)
    logits.sum().backward()  # the gradient reaches the full-size table (learned)
    if pos == "learned":
        assert m.pos_embed.grad is not None and m.pos_embed.grad.abs().sum() > 0
    m.eval()
    with torch.no_grad():
        _, attn = m.forward_with_attention(torch.randn(1, 3, 32, 32))
    assert attn.shape[-1] == 65  # evaluation at full size is unchanged
