"""TTA around the model (:mod:`vit_service.tta`): the answer averages the views (flip, and
flip + one-pixel shifts), the weights are the given view's, on every attention path and
precision."""

from __future__ import annotations

import pytest
import torch

from vit_service.models import create_model
from vit_service.models.layers import set_fused_attn
from vit_service.precision import inference_precision
from vit_service.tta import flips, predict, predict_with_attention, shifts


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weights_are_the_given_views_and_logits_the_mean_of_both(fused: bool,
                                                                  precision: str) -> None:
    torch.manual_seed(0)
    model = create_model("vit_test", tta_flip=True, pool="mean").eval()
    set_fused_attn(model, fused)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), inference_precision(model, precision):  # type: ignore[arg-type]
        logits, attn = predict_with_attention(model, x)
        given, want_attn = model.forward_with_attention(x)
        mirror = model(x.flip(-1))
        plain = predict(model, x)
    torch.testing.assert_close(attn, want_attn, atol=0, rtol=0)
    torch.testing.assert_close(logits, torch.stack([given, mirror]).mean(0), atol=0, rtol=0)
    tol = 1e-5 if precision == "fp32" else 0.05
    torch.testing.assert_close(plain.float(), logits.float(), atol=tol, rtol=0)


def test_only_an_eval_mode_tta_model_flips() -> None:
    model = create_model("vit_test", tta_flip=True)
    assert not flips(model.train()) and flips(model.eval())
    assert not flips(create_model("vit_test").eval())
    assert not flips(create_model("text_test").eval())


def _moved(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` with its content moved ``d`` = +1 / -1 pixel down and right, the edge reflected
    (built from indices, not from the code under test)."""
    n = x.shape[-1]
    idx = torch.tensor([1, *range(n - 1)]) if d == 1 else torch.tensor([*range(1, n), n - 2])
    return x[..., idx, :][..., idx]


def test_moved_views_are_one_pixel_shifts() -> None:
    x = torch.arange(16.0).view(1, 1, 4, 4)
    assert _moved(x, 1)[0, 0, 1:, 1:].equal(x[0, 0, :-1, :-1])
    assert _moved(x, -1)[0, 0, :-1, :-1].equal(x[0, 0, 1:, 1:])


@pytest.mark.parametrize("fused", [True, False])
def test_shift_tta_weighs_the_given_pair_half_and_the_shifted_pairs_half(fused: bool) -> None:
    torch.manual_seed(0)
    model = create_model("vit_test", tta_flip=True, tta_shift=True, pool="mean").eval()
    set_fused_attn(model, fused)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        pair = [model(v) + model(v.flip(-1)) for v in (x, _moved(x, 1), _moved(x, -1))]
        want = pair[0] / 4 + (pair[1] + pair[2]) / 8
        got = predict(model, x)
        logits, attn = predict_with_attention(model, x)
        given, want_attn = model.forward_with_attention(x)
        flip_only = predict(model, x, shift=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(attn, want_attn, atol=0, rtol=0)  # the given view's weights
    torch.testing.assert_close(flip_only, (given + model(x.flip(-1))) / 2, atol=1e-5, rtol=0)
    assert not torch.allclose(got, flip_only, atol=1e-4)


def test_only_an_eval_mode_flip_and_shift_model_shifts() -> None:
    model = create_model("vit_test", tta_flip=True, tta_shift=True)
    assert not shifts(model.train()) and shifts(model.eval())
    assert not shifts(create_model("vit_test", tta_flip=True).eval())
    with pytest.raises(ValueError, match="tta_shift needs tta_flip"):
        create_model("vit_test", tta_shift=True)
