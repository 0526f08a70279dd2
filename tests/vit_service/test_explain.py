"""Relevance and faithfulness (vit_service.explain) on constructed and tiny random models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vit_service.attention_maps import attention_rollout
from vit_service.explain import (
    attention_gradients,
    explain,
    faithfulness_curves,
    image_probs_fn,
    keep_masks,
    step_counts,
    text_probs_fn,
)
from vit_service.models.layers import set_fused_attn
from vit_service.models.text import TextConfig, TextTransformer
from vit_service.models.vit import ViT, ViTConfig


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.eval()


def one_patch_vit(patch_index: int) -> ViT:
    """A 16x16 ViT (4x4 grid) whose class-1 logit depends on patch ``patch_index`` only.

    Block 0 does no attention (zero projection); its MLP passes a patch's channel-0 sum through
    GELU(s - 8), so a bright patch (sum 16) gives 8 and a dim or mean-filled one ~0. Block 1
    attends uniformly (zero q, k) and its values read that MLP output, so the [CLS] token gets
    mean_j(mlp_j) and the head reads it. The patch that matters is made bright in the image;
    rollout is uniform here by construction.
    """
    m = _zeroed(ViT(ViTConfig(img_size=16, patch_size=4, embed_dim=4, depth=2, num_heads=1,
                              num_classes=10, drop_path_rate=0.0)))
    m.norm, m.pos_embed.data[:] = nn.Identity(), 0.0
    for blk in m.blocks:
        blk.norm1, blk.norm2 = nn.Identity(), nn.Identity()
    with torch.no_grad():
        m.patch_embed.proj.weight[0, 0] = 1.0  # dim 0 = the patch's channel-0 sum
        mlp = m.blocks[0].mlp
        mlp.fc1.weight[0, 0], mlp.fc1.bias[0] = 1.0, -8.0  # hidden 0 = sum - 8
        mlp.fc2.weight[1, 0] = 1.0  # -> dim 1
        m.blocks[1].attn.qkv.weight[2 * 4 + 1, 1] = 1.0  # v: dim 1 only
        m.blocks[1].attn.proj.weight[1, 1] = 1.0
        m.head.weight[1, 1] = 12.0
    return m


def one_patch_image(patch_index: int) -> torch.Tensor:
    x = torch.zeros(1, 3, 16, 16)
    r, c = divmod(patch_index, 4)
    x[0, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] = 1.0
    return x


def test_relevance_finds_the_one_patch_the_logit_depends_on() -> None:
    j = 9
    m, x = one_patch_vit(j), one_patch_image(j)
    ex = explain(m, (x,), target=torch.tensor([1]), grid=(4, 4))
    rel = ex.relevance.reshape(-1)
    assert rel.argmax().item() == j and rel[j] > 0.9
    roll = attention_rollout(ex.attn, grid=(4, 4)).reshape(-1)
    assert torch.allclose(roll, torch.full_like(roll, 1 / 16))  # rollout cannot tell here
    p_full = ex.logits.softmax(-1)[:, 1]
    curves = faithfulness_curves({"relevance": rel[None], "rollout": roll[None]},
                                 torch.ones(1, 16, dtype=torch.bool),
                                 image_probs_fn(m, x, torch.tensor([1]), 4), p_full)
    assert curves["relevance"].deletion[0, 1] < p_full[0] - 0.3  # the first step removes it
    assert curves["relevance"].deletion_auc[0] < 0.8 * curves["random"].deletion_auc[0]
    assert curves["relevance"].insertion_auc[0] > curves["random"].insertion_auc[0]


def one_token_text(word: int) -> TextTransformer:
    """A text model whose class-1 logit is (the share of) token ``word`` among the real
    tokens: uniform attention, values read the embedding of ``word`` only."""
    m = _zeroed(TextTransformer(TextConfig(vocab_size=12, max_len=16, num_classes=10,
                                           embed_dim=4, depth=1, num_heads=1,
                                           pos_encoding="learned",
                                           embed_scale=False, drop_rate=0.0)))
    m.norm = nn.Identity()
    m.blocks[0].norm1, m.blocks[0].norm2 = nn.Identity(), nn.Identity()
    with torch.no_grad():
        m.tok_embed.weight[word, 0] = 1.0
        m.blocks[0].attn.qkv.weight[2 * 4, 0] = 1.0
        m.blocks[0].attn.proj.weight[0, 0] = 1.0
        m.head.weight[1, 0] = 30.0
    return m


def test_relevance_finds_the_one_token_and_zeros_padding() -> None:
    m = one_token_text(word=7)
    ids = torch.tensor([[1, 3, 4, 7, 5, 6, 0, 0]])  # [CLS]=1, word 7 at position 3, 2 pads
    mask = ids != 0
    ex = explain(m, (ids, mask), attention_mask=mask)
    rel = ex.relevance[0]  # positions 1..7
    assert rel.argmax().item() == 2  # position 3 in the sequence
    assert rel[-2:].eq(0).all() and rel.sum().item() == pytest.approx(1.0)
    p_full = ex.logits.softmax(-1).gather(1, ex.target[:, None])[:, 0]
    curves = faithfulness_curves({"relevance": rel[None]}, mask[:, 1:],
                                 text_probs_fn(m, ids, mask, ex.target), p_full)
    assert curves["relevance"].deletion_auc[0] < 0.8 * curves["random"].deletion_auc[0]


def test_attention_gradient_matches_finite_differences() -> None:
    torch.manual_seed(0)
    m = ViT(ViTConfig(img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                      num_classes=3, drop_path_rate=0.0)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    set_fused_attn(m, False)  # the explicit path, where A goes through attn_drop
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    target = torch.tensor([2, 0])
    _, _, grads, _ = attention_gradients(m, (x,), target)

    def score(layer: int, idx: tuple[int, ...], eps: float) -> float:
        def bump(_mod: nn.Module, _inp: tuple, out: torch.Tensor) -> torch.Tensor:
            out = out.clone()
            out[idx] += eps
            return out

        hook = m.blocks[layer].attn.attn_drop.register_forward_hook(bump)  # the A used in A@v
        try:
            with torch.no_grad():
                return m(x).gather(1, target[:, None]).sum().item()
        finally:
            hook.remove()

    eps = 1e-6
    for layer, idx in [(0, (0, 1, 0, 3)), (1, (1, 0, 2, 1)), (1, (0, 1, 0, 0)), (0, (1, 0, 4, 2))]:
        fd = (score(layer, idx, eps) - score(layer, idx, -eps)) / (2 * eps)
        assert grads[layer][idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)


def test_relevance_changes_nothing_in_the_model() -> None:
    torch.manual_seed(0)
    m = ViT(ViTConfig(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                      drop_path_rate=0.1)).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        ref = m(x)
        ex = explain(m, (x,), grid=(4, 4))
        after = m(x)
    assert not m.training
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.equal(ref, after)
    assert torch.allclose(ex.logits, ref, atol=1e-5)  # the explicit path gives the same logits
    assert torch.allclose(ex.relevance.sum((1, 2)), torch.ones(3))


@pytest.mark.parametrize("shift", [False, True])
def test_tta_relevance_explains_the_given_view(shift: bool) -> None:
    from vit_service.tta import predict

    torch.manual_seed(0)
    cfg = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, pool="mean")
    plain = ViT(ViTConfig(**cfg)).eval()
    tta = ViT(ViTConfig(**cfg, tta_flip=True, tta_shift=shift)).eval()
    tta.load_state_dict(plain.state_dict())
    x, target = torch.randn(2, 3, 16, 16), torch.tensor([3, 5])
    a = explain(plain, (x,), target, grid=(4, 4), query="mean")
    b = explain(tta, (x,), target, grid=(4, 4), query="mean")
    assert torch.allclose(a.relevance, b.relevance, atol=1e-5)
    assert not torch.allclose(a.logits, b.logits)  # TTA's logits average the other views too
    with torch.no_grad():
        assert torch.allclose(b.logits, predict(tta, x), atol=1e-5)  # the answer as served


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_flip_tta_relevance_on_every_served_path(precision: str, fused: bool, pool: str) -> None:
    """The served paths: fused or explicit attention, fp32 or bf16 autocast (which serves on
    the explicit path), CLS or mean pooling, flip TTA. Relevance of the TTA model is the plain
    model's on the given view (bf16: to its precision), never an autograd error."""
    from vit_service.precision import inference_precision

    torch.manual_seed(1)
    cfg = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, pool=pool)
    plain = ViT(ViTConfig(**cfg)).eval()
    tta = ViT(ViTConfig(**cfg, tta_flip=True)).eval()
    tta.load_state_dict(plain.state_dict())
    x, target = torch.randn(2, 3, 16, 16), torch.tensor([3, 5])
    query = "mean" if pool == "mean" else "cls"
    out = []
    for m in (plain, tta):
        set_fused_attn(m, fused)
        with torch.inference_mode(), inference_precision(m, precision):  # type: ignore[arg-type]
            out.append(explain(m, (x,), target, grid=(4, 4), query=query))
    a, b = out
    assert torch.isfinite(b.relevance).all()
    assert b.relevance.sum((1, 2)) == pytest.approx(torch.ones(2), abs=1e-5)
    tol = 1e-5 if precision == "fp32" else 0.02
    assert torch.allclose(a.relevance.float(), b.relevance.float(), atol=tol)


class AdditivePatches(nn.Module):
    """logit_1 = 3 * sum over patches of relu(mean of the patch's channel 0); logit_0 = 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = 3 * F.relu(F.avg_pool2d(x[:, :1], 4)).sum((1, 2, 3))  # (B,)
        return torch.stack([torch.zeros_like(s), s], dim=-1)


def test_curves_are_monotone_for_an_additive_model() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 16, 16) * 0.3
    x = x - x.mean(dim=(2, 3), keepdim=True)  # mean colour 0: a removed patch adds nothing
    model, target = AdditivePatches(), torch.tensor([1, 1, 1])
    probs_of = image_probs_fn(model, x, target, 4)
    p_full = model(x).softmax(-1)[:, 1]
    valid = torch.ones(3, 16, dtype=torch.bool)
    assert torch.allclose(probs_of(valid[:, None]), p_full[:, None])  # 100 % = the original
    curves = faithfulness_curves({"m": torch.rand(3, 16)}, valid, probs_of, p_full)
    for c in curves.values():
        assert (c.deletion[:, 1:] <= c.deletion[:, :-1] + 1e-6).all()
        assert (c.insertion[:, 1:] >= c.insertion[:, :-1] - 1e-6).all()
        assert torch.allclose(c.insertion[:, -1], p_full) and torch.allclose(
            c.deletion[:, 0], p_full)
        assert torch.allclose(c.deletion[:, -1], torch.full((3,), 0.5))  # logit 0 vs 0
        assert torch.allclose(c.fractions[0], torch.tensor([round(k * 1.6) / 16
                                                            for k in range(11)]))


def test_keep_masks_follow_the_order() -> None:
    order = torch.tensor([[2, 0, 3, 1]])
    counts = step_counts(torch.tensor([4]), steps=4)  # 0, 1, 2, 3, 4
    dele = keep_masks(order, counts, insertion=False)[0]
    ins = keep_masks(order, counts, insertion=True)[0]
    assert dele[1].tolist() == [True, True, False, True]  # position 2 goes first
    assert dele[2].tolist() == [False, True, False, True]
    assert ins[2].tolist() == [True, False, True, False]
    assert (dele ^ ins).all()
