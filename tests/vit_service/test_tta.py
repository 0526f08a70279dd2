"""Flip TTA around the model (:mod:`vit_service.tta`): the answer averages both views, the
weights are the given view's, on every attention path and precision."""

from __future__ import annotations

import pytest
import torch

from vit_service.models import create_model
from vit_service.models.layers import set_fused_attn
from vit_service.precision import inference_precision
from vit_service.tta import flips, predict, predict_with_attention


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
