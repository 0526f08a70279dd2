import random

import pytest
import torch
import torch.nn.functional as F

from training.augment import (
    CutMix,
    ImageAugment,
    normalize,
    random_crop,
    random_hflip,
    smooth,
    smooth_one_hot,
)


def _zeros_and_ones(b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch whose first half is all zeros (class 0), second half all ones (class 1); the
    reversed-batch partner of a zeros image is a ones image."""
    x = torch.cat([torch.zeros(b // 2, 3, 32, 32), torch.ones(b // 2, 3, 32, 32)])
    y = torch.tensor([0] * (b // 2) + [1] * (b // 2))
    return x, y


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cutmix_label_weight_equals_the_pasted_area(smoothing: float) -> None:
    rng = random.Random(0)
    cm = CutMix(alpha=1.0, prob=1.0, num_classes=10, label_smoothing=smoothing, rng=rng)
    clipped = 0
    for _ in range(200):
        x, y = _zeros_and_ones(4)
        xm, ys = cm(x, y)
        pasted = xm[0].mean().item()  # share of ones pasted into a zeros image
        assert xm[-1].mean().item() == pytest.approx(1 - pasted)  # and zeros into ones
        # label weight of the partner's class = pasted area (after smoothing)
        expected = smooth_one_hot(torch.tensor([0]), 10, smoothing)[0] * (1 - pasted) + \
            smooth_one_hot(torch.tensor([1]), 10, smoothing)[0] * pasted
        torch.testing.assert_close(ys[0], expected, atol=1e-6, rtol=0)
        assert ys.sum(-1).allclose(torch.ones(4))
        assert cm.last_lam == pytest.approx(1 - pasted)
        # a box centred near the border is clipped: lambda must follow the clipped area
        clipped += int(0 < pasted < 0.99 and (xm[0, 0, 0].any() or xm[0, 0, -1].any()))
    assert clipped > 10  # the loop did exercise boxes touching the border


def test_cutmix_prob_zero_and_mixup() -> None:
    x, y = _zeros_and_ones(2)
    cm = CutMix(prob=0.0, num_classes=2, label_smoothing=0.0, rng=random.Random(0))
    xm, ys = cm(x, y)
    assert torch.equal(xm, x) and torch.equal(ys, F.one_hot(y, 2).float())
    mix = CutMix(prob=0.0, num_classes=2, mixup_alpha=0.4, rng=random.Random(1))
    for _ in range(20):
        xm, ys = mix(x, y)
        lam = mix.last_lam
        assert xm[0].mean().item() == pytest.approx(1 - lam, abs=1e-6)  # blended pixels
        assert ys[0, 1].item() == pytest.approx(1 - lam, abs=1e-6)  # and labels, the same


def test_smooth_one_hot() -> None:
    t = smooth_one_hot(torch.tensor([2, 0]), 4, 0.2)
    assert t.sum(-1).allclose(torch.ones(2))
    assert t[0, 2].item() == pytest.approx(0.85) and t[0, 0].item() == pytest.approx(0.05)


def test_smoothing_soft_targets_keeps_rows_summing_to_one_and_matches_one_hot() -> None:
    p = torch.tensor([[0.7, 0.3], [0.0, 1.0]])
    s = smooth(p, 0.1)
    assert s.sum(-1).allclose(torch.ones(2))
    assert s[0].tolist() == pytest.approx([0.7 * 0.9 + 0.05, 0.3 * 0.9 + 0.05])
    assert torch.allclose(s[1], smooth_one_hot(torch.tensor([1]), 2, 0.1)[0])


def _batch(b: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 256, (b, 3, 32, 32), generator=g, dtype=torch.uint8)


def test_random_crop_shapes_determinism_and_windows() -> None:
    x = _batch()
    torch.manual_seed(1)
    a = random_crop(x, 4)
    torch.manual_seed(1)
    b = random_crop(x, 4)
    assert a.shape == x.shape and a.dtype == torch.uint8
    assert torch.equal(a, b)
    assert not torch.equal(a, random_crop(x, 4))
    padded = F.pad(x, (4, 4, 4, 4))
    for i in range(x.shape[0]):  # every output is a 32x32 window of the padded input
        assert any(torch.equal(a[i], padded[i, :, dy:dy + 32, dx:dx + 32])
                   for dy in range(9) for dx in range(9))
    assert torch.equal(random_crop(x, 0), x)


def test_random_hflip_determinism_and_content() -> None:
    x = _batch(16)
    torch.manual_seed(3)
    a = random_hflip(x)
    torch.manual_seed(3)
    assert torch.equal(a, random_hflip(x))
    flipped = [torch.equal(a[i], x[i].flip(-1)) for i in range(16)]
    kept = [torch.equal(a[i], x[i]) for i in range(16)]
    assert all(f or k for f, k in zip(flipped, kept, strict=True))
    assert any(flipped) and any(kept)


def test_normalize_and_pipeline() -> None:
    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = normalize(x, torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.5, 0.25, 1.0]))
    assert torch.allclose(out[:, 0], torch.ones(1)) and torch.allclose(out[:, 1], torch.tensor(2.))
    aug = ImageAugment((0.5,) * 3, (0.5,) * 3, crop_padding=4, hflip=True, randaugment_ops=2)
    y = aug(_batch(), train=True)
    assert y.shape == (8, 3, 32, 32) and y.dtype == torch.float32
    assert torch.equal(aug(_batch(), train=False), aug(_batch(), train=False))


def test_token_dropout_hides_real_tokens_at_its_rate_and_never_cls() -> None:
    from training.augment import token_dropout

    torch.manual_seed(0)
    mask = torch.ones(64, 200, dtype=torch.bool)
    mask[:, 150:] = False  # padding stays padding
    out = token_dropout(mask, 0.25)
    assert out[:, :2].all() and not out[:, 150:].any()
    frac = 1 - out[:, 2:150].float().mean().item()
    assert 0.22 < frac < 0.28
    assert torch.equal(token_dropout(mask, 0.0), mask)
