"""``vit_service.precision``: which precision ``auto`` picks, and what a bf16 block runs."""

from __future__ import annotations

import pytest
import torch

from vit_service.models import create_model
from vit_service.models.layers import Attention
from vit_service.precision import autocast_dtype, inference_precision, resolve_precision


@pytest.mark.parametrize(("choice", "native", "device", "want"), [
    ("auto", True, "cpu", "bf16"), ("auto", False, "cpu", "fp32"),
    ("fp32", True, "cpu", "fp32"), ("bf16", False, "cpu", "bf16"),
    ("auto", True, "cuda", "fp32"), ("bf16", True, "cuda", "fp32"),
])
def test_resolve_precision(choice: str, native: bool, device: str, want: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vit_service.precision.cpu_has_native_bf16", lambda: native)
    assert resolve_precision(choice, device) == want
    assert autocast_dtype(want) == (torch.bfloat16 if want == "bf16" else None)  # type: ignore[arg-type]


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16"):
        resolve_precision("fp16")


def test_bf16_block_runs_autocast_on_the_explicit_path_and_restores_it() -> None:
    model = create_model("vit_test").eval()
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    attns[0].fused_attn = False  # a module's own setting comes back, whatever it was
    seen: list[bool] = []
    hook = attns[1].register_forward_pre_hook(lambda m, a: seen.append(m.fused_attn))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        with inference_precision(model, "bf16"):
            assert model(x).dtype == torch.bfloat16
        assert seen == [False]
        with inference_precision(model, "fp32"):
            assert model(x).dtype == torch.float32
        assert seen == [False, True]
    hook.remove()
    assert [m.fused_attn for m in attns] == [False] + [True] * (len(attns) - 1)
