"""The pictures a run publishes beside its model, from a few validation examples: the
attention rollout sheet (images) or page (reviews) of a classifier, and what a masked
autoencoder reconstructs. Rendering lives in :mod:`training.reporting`."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch
from torch import nn

from training.augment import normalize
from training.objectives import VAL_MASK_SEED
from training.tasks import ImageTask, Task, TextTask
from vit_service.pipeline import read_tokens
from vit_service.tta import predict_with_attention


def _rows(n_val: int, n: int) -> torch.Tensor:
    """``n`` validation rows spread over the split."""
    return torch.linspace(0, n_val - 1, min(n, n_val)).long()


@torch.no_grad()
def attention_report(task: Task, model: nn.Module, out_dir: Path, n: int) -> Path | None:
    """Attention rollout of ``n`` validation examples rendered into ``out_dir``; the file."""
    if n <= 0 or not hasattr(model, "forward_with_attention"):
        return None
    if isinstance(task, ImageTask):
        return _image_attention(task, model, out_dir, n)
    if isinstance(task, TextTask):
        return _text_attention(task, model, out_dir, n)
    return None


def _image_attention(task: ImageTask, model: nn.Module, out_dir: Path, n: int) -> Path:
    from training.reporting import image_attention_sheet

    rows = _rows(task.n_val, n).to(task.device)
    raw = task.val_x[rows]  # (n, 3, H, W) uint8
    logits, attn = predict_with_attention(model, normalize(raw, task.augment.mean,
                                                           task.augment.std))
    probs = logits.float().softmax(-1)
    return image_attention_sheet(
        raw.permute(0, 2, 3, 1).cpu().numpy(), attn.float().cpu(), model.config.grid_size,
        model.config.pool, task.val_y[rows].tolist(), probs.cpu(), task.class_names,
        out_dir / "attention_rollout.png",
    )


def _text_attention(task: TextTask, model: nn.Module, out_dir: Path, n: int) -> Path:
    from vit_service.attention_maps import attention_rollout

    rows = np.linspace(0, task.n_val - 1, min(n, task.n_val)).astype(int).tolist()
    enc = task.tokenizer.encode_batch([task.val_texts[i] for i in rows], task.max_len,
                                      task.recipe.data.truncation)
    ids, mask = enc.input_ids.to(task.device), enc.attention_mask.to(task.device)
    logits, attn = predict_with_attention(model, ids, mask)
    probs = logits.float().softmax(-1).cpu()
    read = read_tokens(model, ids, mask, attn.shape[-1])  # a crop model's attention: its crop
    maps = read.place(attention_rollout(attn.float(), attention_mask=read.mask,
                                        query=model.config.pool)).cpu()  # (n, T-1)
    parts = ["<html><head><meta charset='utf-8'><title>attention rollout</title></head>",
             "<body style='font-family:sans-serif;max-width:60em'>",
             "<h2>[CLS] attention rollout on validation reviews</h2>"]
    for j, i in enumerate(rows):
        true = task.class_names[int(task.val_y[i])]
        pred = int(probs[j].argmax())
        parts.append(f"<h4>review {i}: true <b>{true}</b>, predicted "
                     f"<b>{task.class_names[pred]}</b> ({float(probs[j, pred]):.2f})</h4><p>")
        w = maps[j]
        top = float(w.max()) or 1.0
        for t, tok in enumerate(enc.pieces[j][1:]):
            a = float(w[t]) / top
            parts.append(f"<span style='background:rgba(255,80,0,{a:.3f})'>"
                         f"{html.escape(tok)}</span> ")
        parts.append("</p>")
    parts.append("</body></html>")
    path = out_dir / "attention_rollout.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


@torch.no_grad()
def reconstruction_report(task: Task, model: nn.Module, out_dir: Path, n: int) -> Path | None:
    """MAE: original / masked input / reconstruction of ``n`` validation images (PNG); None
    for any other objective."""
    from training.reporting import mae_reconstruction_sheet

    if not isinstance(task, ImageTask) or task.objective != "mae" or n <= 0:
        return None
    was_training = model.training
    model.eval()
    rows = _rows(task.n_val, n).to(task.device)
    raw = task.val_x[rows]  # (n, 3, H, W) uint8
    x = normalize(raw, task.augment.mean, task.augment.std)
    g = torch.Generator(device=task.device).manual_seed(VAL_MASK_SEED)
    loss, pred, mask = model(x, generator=g)  # pred (n, N, p*p*3), mask (n, N) 1 = hidden
    rec = model.reconstruct(x, pred, mask)  # (n, 3, H, W) normalised, visible pasted
    model.train(was_training)
    mean = task.augment.mean.view(1, 3, 1, 1)
    std = task.augment.std.view(1, 3, 1, 1)
    rec_u8 = ((rec * std + mean) * 255).clamp(0, 255).round().to(torch.uint8)
    p = model.config.encoder.patch_size
    pix_mask = mask.view(-1, 1, *model.config.encoder.grid_size)  # (n, 1, Gh, Gw)
    pix_mask = pix_mask.repeat_interleave(p, 2).repeat_interleave(p, 3).bool()
    masked = torch.where(pix_mask, torch.full_like(raw, 127), raw)  # grey hidden patches

    def to_np(t: torch.Tensor) -> np.ndarray:
        return t.permute(0, 2, 3, 1).cpu().numpy()  # (n, H, W, 3)

    return mae_reconstruction_sheet(to_np(raw), to_np(masked), to_np(rec_u8), float(loss),
                                    model.config.mask_ratio, out_dir / "mae_reconstructions.png")
