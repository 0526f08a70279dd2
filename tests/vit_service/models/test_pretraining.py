import pytest
import torch

from vit_service.models import create_model, get_config
from vit_service.models.mae import MAE, MAEConfig, patchify, random_masking, unpatchify
from vit_service.models.mlm import IGNORE, MLM, MLMConfig, mlm_mask


def _mae(ratio: float = 0.75) -> MAE:
    torch.manual_seed(0)
    enc = get_config("vit_test", num_classes=0, patch_size=4)  # 8x8 = 64 patches
    return MAE(MAEConfig(encoder=enc, mask_ratio=ratio, decoder_dim=32, decoder_heads=2))


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.9])
def test_masking_keeps_exactly_the_requested_ratio(ratio: float) -> None:
    ids_keep, mask, ids_restore = random_masking(64, 16, ratio)
    keep = round(64 * (1 - ratio))
    assert ids_keep.shape == (16, keep)
    assert torch.all(mask.sum(1) == 64 - keep)
    # the kept ids are exactly the unmasked positions
    for b in range(16):
        assert set(ids_keep[b].tolist()) == set((mask[b] == 0).nonzero().flatten().tolist())
    # masks differ between samples (per-sample randomness)
    assert not torch.equal(mask[0], mask[1])


def test_patchify_round_trip_and_order_matches_patch_conv() -> None:
    imgs = torch.randn(2, 3, 32, 32)
    p = patchify(imgs, 4)
    assert p.shape == (2, 64, 48)
    torch.testing.assert_close(unpatchify(p, 4, (8, 8)), imgs)
    # patch 1 (row 0, column 1) holds pixels [0:4, 4:8]
    torch.testing.assert_close(p[0, 1].reshape(4, 4, 3).permute(2, 0, 1), imgs[0, :, 0:4, 4:8])


def test_loss_counts_only_masked_patches() -> None:
    mae = _mae()
    imgs = torch.randn(4, 3, 32, 32)
    _, mask, _ = random_masking(64, 4, 0.75, generator=torch.Generator().manual_seed(1))
    pred = torch.randn(4, 64, 48)
    base = mae.loss(imgs, pred, mask)
    visible_changed = pred + (1 - mask)[..., None] * 100.0
    torch.testing.assert_close(mae.loss(imgs, visible_changed, mask), base)
    masked_changed = pred + mask[..., None] * 1.0
    assert not torch.allclose(mae.loss(imgs, masked_changed, mask), base)


def test_mae_trains_and_its_encoder_loads_into_a_classifier() -> None:
    mae = _mae()
    imgs = torch.randn(4, 3, 32, 32)
    loss, pred, mask = mae(imgs)
    assert pred.shape == (4, 64, 48) and mask.sum() == 4 * 48
    loss.backward()
    assert mae.encoder.patch_embed.proj.weight.grad is not None
    clf = create_model("vit_test", patch_size=4, num_classes=10)
    missing, unexpected = clf.load_state_dict(mae.encoder.state_dict(), strict=False)
    assert set(missing) == {"head.weight", "head.bias"} and not unexpected
    torch.testing.assert_close(clf.patch_embed.proj.weight, mae.encoder.patch_embed.proj.weight)
    rec = mae.reconstruct(imgs, pred.detach(), mask)
    assert rec.shape == imgs.shape
    # visible patches are the input's own pixels
    vis = (1 - mask)[..., None].bool().expand(-1, -1, 48)
    torch.testing.assert_close(patchify(rec, 4)[vis], patchify(imgs, 4)[vis])


def test_mlm_masking_follows_80_10_10_and_never_masks_padding() -> None:
    g = torch.Generator().manual_seed(0)
    B, T, V, MASK = 64, 128, 1000, 4
    ids = torch.randint(5, V, (B, T), generator=g)
    ids[:, 0] = 2  # [CLS]
    lengths = torch.randint(10, T, (B,), generator=g)
    attn = torch.arange(T)[None] < lengths[:, None]
    ids[~attn] = 0  # [PAD]
    inputs, labels = mlm_mask(ids, attn, mask_id=MASK, vocab_size=V, generator=g)
    sel = labels != IGNORE
    assert not sel[~attn].any(), "padding selected"
    assert not sel[:, 0].any(), "[CLS] selected"
    assert torch.equal(inputs[~attn], ids[~attn])
    frac = sel.sum() / (attn.sum() - B)
    assert 0.13 < frac < 0.17
    n = sel.sum().item()
    as_mask = (inputs[sel] == MASK).sum().item() / n
    unchanged = (inputs[sel] == ids[sel]).sum().item() / n
    randomised = 1 - as_mask - unchanged
    assert 0.77 < as_mask < 0.83
    assert 0.08 < unchanged < 0.12 + 0.01  # a random replacement can hit the same id (1/V)
    assert 0.08 < randomised < 0.12
    assert torch.equal(labels[sel], ids[sel])
    assert torch.all(inputs[~sel] == ids[~sel])


def test_mlm_model_loss_and_encoder_transfer() -> None:
    torch.manual_seed(0)
    enc = get_config("text_test", num_classes=0)
    mlm = MLM(MLMConfig(encoder=enc))
    ids = torch.randint(5, 1000, (4, 20))
    attn = torch.ones_like(ids, dtype=torch.bool)
    inputs, labels = mlm_mask(ids, attn, mask_id=4, vocab_size=1000, mask_prob=0.3)
    loss, logits = mlm(inputs, attn, labels)
    assert logits.shape == ((labels != IGNORE).sum().item(), 1000)
    assert abs(loss.item() - torch.log(torch.tensor(1000.0)).item()) < 1.5
    loss.backward()
    clf = create_model("text_test", num_classes=2)
    missing, unexpected = clf.load_state_dict(mlm.encoder.state_dict(), strict=False)
    assert set(missing) == {"head.weight", "head.bias"} and not unexpected
