"""``serving.compiled``: traced serving forwards equal the eager model, or are not used."""

import torch
from torch import nn

from serving.compiled import trace_forwards
from vit_service.models import create_model
from vit_service.models.layers import Attention
from vit_service.pipeline import ExplainSpec, TextInputs, explain_batch
from vit_service.precision import inference_precision
from vit_service.tta import predict, predict_with_attention


def _frozen(m: nn.Module) -> nn.Module:
    for p in m.parameters():
        p.requires_grad_(False)
    return m.eval()


def test_traced_vit_and_text_forwards_equal_the_eager_model_at_other_sizes() -> None:
    torch.manual_seed(0)
    vit = _frozen(create_model("vit_test", tta_flip=True, pool="mean"))
    f = trace_forwards(vit, "image", {"image_size": 32})
    assert f.traced
    x = torch.randn(9, 3, 32, 32)  # traced at 3, checked at 3 and 5
    with torch.inference_mode():
        torch.testing.assert_close(f.plain(x), predict(vit, x))
        logits, attn = f.with_attention(x)
        want_logits, want_attn = predict_with_attention(vit, x)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(attn, want_attn)

    text = _frozen(create_model("text_test", vocab_size=50, max_len=32))
    f = trace_forwards(text, "text", {"max_len": 32})
    assert f.traced
    ids = torch.randint(5, 50, (4, 20))
    mask = torch.arange(20)[None] < torch.tensor([20, 13, 2, 7])[:, None]
    ids = ids.masked_fill(~mask, 0)
    with torch.inference_mode():
        torch.testing.assert_close(f.plain(ids, mask), text(ids, mask))
        torch.testing.assert_close(f.with_attention(ids, mask)[1],
                                   text.forward_with_attention(ids, mask)[1])


class _BranchesOnBatch(nn.Module):
    """Python control flow on the batch size: a trace freezes the branch it saw."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :4] * (2.0 if x.shape[0] > 3 else 1.0)

    def forward_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(x), x.new_zeros(1, x.shape[0], 1, 2, 2)


class _Broken(_BranchesOnBatch):
    def forward_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("no attention here")


def test_a_trace_that_disagrees_or_fails_falls_back_to_the_eager_model() -> None:
    for model in (_BranchesOnBatch(), _Broken()):
        f = trace_forwards(model.eval(), "image", {"image_size": 8}, "tricky")
        assert not f.traced
        assert f.plain is model  # eager: the same answers as without tracing


def test_bf16_traces_equal_the_eager_bf16_model_and_answer_in_fp32() -> None:
    """In bf16 the traces hold autocast's casts (explicit attention) and match the eager model
    run in bf16 exactly; the callables hand back fp32; TorchScript's autocast switch and the
    model's attention path are as they were."""
    torch.manual_seed(0)
    vit = _frozen(create_model("vit_test", tta_flip=True, pool="mean"))
    jit_autocast = torch._C._jit_set_autocast_mode(True)
    torch._C._jit_set_autocast_mode(jit_autocast)
    f = trace_forwards(vit, "image", {"image_size": 32}, precision="bf16")
    assert f.traced and f.precision == "bf16"
    assert torch._C._jit_set_autocast_mode(jit_autocast) == jit_autocast  # restored
    assert all(m.fused_attn for m in vit.modules() if isinstance(m, Attention))
    x = torch.randn(7, 3, 32, 32)
    with torch.inference_mode():
        logits, attn = f.with_attention(x)
        plain = f.plain(x)
        with inference_precision(vit, "bf16"):
            want_logits, want_attn = predict_with_attention(vit, x)
        fp32_logits = predict(vit, x)
    assert logits.dtype == attn.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(plain, want_logits.float(), rtol=0, atol=0)
    torch.testing.assert_close(attn, want_attn.float(), rtol=0, atol=0)
    assert not torch.equal(plain, fp32_logits)  # it did run in bf16
    torch.testing.assert_close(plain, fp32_logits, rtol=0.05, atol=0.05)  # and close to fp32
    torch.testing.assert_close(attn.sum(-1), torch.ones_like(attn.sum(-1)), rtol=0, atol=1e-2)

    eager = trace_forwards(_BranchesOnBatch().eval(), "image", {"image_size": 8}, "tricky",
                           precision="bf16")
    assert not eager.traced and eager.precision == "bf16"  # the fallback keeps the precision
    assert eager.plain(torch.randn(5, 3, 8, 8)).dtype == torch.float32


def test_a_text_model_reading_a_crop_is_traced_on_the_crop_and_equals_it_at_any_length(
        ) -> None:
    torch.manual_seed(0)
    m = _frozen(create_model("text_test", vocab_size=50, max_len=40, student_len=10,
                             pool="mean", ngram_head_buckets=64, ngram_head_unit="word"))
    with torch.no_grad():
        m.ngram_head.weight.normal_()
    f = trace_forwards(m, "text", {"max_len": 40})
    assert f.traced
    for T, lengths in ((40, [40, 33, 9, 2]), (25, [25, 11, 10, 3]), (6, [6, 5, 2, 1])):
        ids = torch.randint(5, 50, (4, T))
        mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
        ids = ids.masked_fill(~mask, 0)
        with torch.inference_mode():
            torch.testing.assert_close(f.plain(ids, mask), m(ids, mask))
            got = explain_batch(m, TextInputs(ids, mask), ExplainSpec(heads=True), f)
            want = explain_batch(m, TextInputs(ids, mask), ExplainSpec(heads=True))
        assert got.maps is not None and want.maps is not None
        for g, w in ((got.maps.rollout, want.maps.rollout), (got.maps.layers, want.maps.layers),
                     (got.maps.heads, want.maps.heads)):
            assert g is not None and w is not None and g.shape[-1] == T - 1
            torch.testing.assert_close(g, w)


def test_traced_shift_tta_equals_the_eager_model() -> None:
    torch.manual_seed(0)
    vit = _frozen(create_model("vit_test", tta_flip=True, tta_shift=True, pool="mean"))
    f = trace_forwards(vit, "image", {"image_size": 32})
    assert f.traced
    x = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(f.plain(x), predict(vit, x))
        logits, attn = f.with_attention(x)
        want_logits, want_attn = predict_with_attention(vit, x)
        flip_only = predict(vit, x, shift=False)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(attn, want_attn)
    assert not torch.allclose(logits, flip_only, atol=1e-4)  # the trace holds the shifts
