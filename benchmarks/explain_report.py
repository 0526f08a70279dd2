"""How faithful is each map? Deletion / insertion AUCs and cost of last-layer attention, rollout,
relevance and a random order, on the validation split, with the trained models.

    python benchmarks/explain_report.py --image-model PATH_OR_NAME --text-model PATH_OR_NAME \
        --data-dir ../shared/data --n 500

A model is a bundle folder (``$VIT_SERVICE_HOME/runs/<run>/bundle``) or a registered name.
Every map is scored by the same functions the API's ``faithfulness=true`` uses
(:mod:`vit_service.explain`): 10 steps, images' removed patches filled with the image's mean
colour, texts' removed tokens masked out of attention, the explained class = the predicted one.
Cost: milliseconds per input for the fused forward (no maps), the explicit forward + rollout +
per-layer maps (what ``attention=rollout`` does), and the forward + backward + relevance
(``attention=relevance``), each timed over the same batches in this run. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from training.evaluate import _bundle_dir, bundle_val_rows
from vit_service.attention_maps import compute_attention_maps
from vit_service.bundle import ModelBundle, load_bundle
from vit_service.data import load_cifar10, load_imdb
from vit_service.explain import explain, faithfulness_curves, image_probs_fn, text_probs_fn
from vit_service.pipeline import ReadTokens, read_tokens

log = logging.getLogger("explain_report")
MAPS = ("last_layer", "rollout", "relevance")


@dataclass
class Tally:
    deletion: dict[str, list[float]] = field(default_factory=dict)
    insertion: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: {"none": 0.0, "rollout": 0.0,
                                                                "relevance": 0.0})
    n: int = 0

    def add(self, curves: dict[str, Any]) -> None:
        for name, c in curves.items():
            self.deletion.setdefault(name, []).extend(c.deletion_auc.tolist())
            self.insertion.setdefault(name, []).extend(c.insertion_auc.tolist())


def _timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def _val_rows(bundle: ModelBundle, labels: np.ndarray, n: int) -> np.ndarray:
    rows = bundle_val_rows(bundle.meta, labels)
    return rows[np.random.default_rng(0).permutation(len(rows))[:n]]  # a fixed random subset


def _score(bundle: ModelBundle, inputs: tuple[torch.Tensor, ...], mask: torch.Tensor | None,
           grid: tuple[int, int] | None, probs_fn, valid: torch.Tensor, tally: Tally) -> None:
    net = bundle.model
    query = "mean" if getattr(net.config, "pool", "cls") == "mean" else "cls"
    # a crop model's maps are computed over its crop and placed at the input's positions
    read = ReadTokens(None) if mask is None else read_tokens(net, inputs[0], mask)
    with torch.inference_mode():
        _, t_none = _timed(net, *inputs)
        (logits, attn), t_attn = _timed(net.forward_with_attention, *inputs)
        maps, t_maps = _timed(compute_attention_maps, attn, read.mask, grid, query=query)
        ex, t_rel = _timed(explain, net, inputs, None, read.mask, grid, query)
    maps, relevance = read.place_maps(maps), read.place(ex.relevance)
    tally.seconds["none"] += t_none
    tally.seconds["rollout"] += t_attn + t_maps
    tally.seconds["relevance"] += t_rel
    B = logits.shape[0]
    target = ex.target
    p_full = ex.logits.float().softmax(-1).gather(1, target[:, None])[:, 0]
    scored = {"last_layer": maps.layers[:, -1].reshape(B, -1),
              "rollout": maps.rollout.reshape(B, -1),
              "relevance": relevance.reshape(B, -1)}
    with torch.inference_mode():
        tally.add(faithfulness_curves(scored, valid, probs_fn(target), p_full))
    tally.n += B


def image_report(ref: str, data_dir: str, n: int, batch: int) -> Tally:
    with tempfile.TemporaryDirectory() as tmp:
        b = load_bundle(_bundle_dir(ref, tmp))
    p = b.meta.preprocess
    ds = load_cifar10(data_dir, "train", image_size=int(p["image_size"]))
    rows = _val_rows(b, ds.labels, n)
    mean, std = torch.tensor(p["mean"]).view(1, 3, 1, 1), torch.tensor(p["std"]).view(1, 3, 1, 1)
    grid = tuple(b.model.config.grid_size)
    tally = Tally()
    for s in range(0, len(rows), batch):
        r = rows[s:s + batch]
        x = (torch.from_numpy(ds.images[r]).permute(0, 3, 1, 2).float() / 255 - mean) / std
        _score(b, (x,), None, grid,
               lambda tgt, x=x: image_probs_fn(b.model, x, tgt, b.model.config.patch_size),
               torch.ones(len(r), grid[0] * grid[1], dtype=torch.bool), tally)
        log.info("images %d/%d", tally.n, len(rows))
    return tally


def _text_batches(b: ModelBundle, data_dir: str, n: int, batch: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    p = b.meta.preprocess
    tds = load_imdb(data_dir, "train")
    rows = _val_rows(b, np.asarray(tds.labels), n)
    ids, lengths = b.tokenizer.encode_to_arrays([tds.texts[i] for i in rows], int(p["max_len"]),
                                                truncation=p.get("truncation", "head"))
    for s in range(0, len(rows), batch):
        T = int(lengths[s:s + batch].max())
        x = torch.from_numpy(ids[s:s + batch, :T]).long()
        mask = torch.arange(T)[None, :] < torch.from_numpy(lengths[s:s + batch])[:, None]
        yield x, mask


def text_report(ref: str, data_dir: str, n: int, batch: int) -> Tally:
    with tempfile.TemporaryDirectory() as tmp:
        b = load_bundle(_bundle_dir(ref, tmp))
    tally = Tally()
    for x, mask in _text_batches(b, data_dir, n, batch):
        _score(b, (x, mask), mask, None,
               lambda tgt, x=x, mask=mask: text_probs_fn(b.model, x, mask, tgt),
               mask[:, 1:], tally)
        log.info("reviews %d/%d", tally.n, n)
    return tally


def table(title: str, t: Tally) -> str:
    rand_d = float(np.mean(t.deletion["random"]))
    lines = [f"**{title}** ({t.n} validation inputs)", "",
             "| map | deletion AUC (lower is better) | / random | insertion AUC (higher is "
             "better) | ms per input |", "|---|---:|---:|---:|---:|"]
    cost = {"last_layer": t.seconds["rollout"], "rollout": t.seconds["rollout"],
            "relevance": t.seconds["relevance"], "random": 0.0}
    for name in (*MAPS, "random"):
        d, i = float(np.mean(t.deletion[name])), float(np.mean(t.insertion[name]))
        ms = 1000 * cost[name] / t.n
        lines.append(f"| {name} | {d:.3f} | {d / rand_d:.2f} | {i:.3f} | "
                     f"{ms:.2f} |" if name != "random" else
                     f"| random | {d:.3f} | 1.00 | {i:.3f} | - |")
    lines.append(f"\nfused forward without maps: {1000 * t.seconds['none'] / t.n:.2f} ms per "
                 "input; last-layer and rollout come from the same explicit pass.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-model")
    ap.add_argument("--text-model")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    out = []
    if args.image_model:
        out.append(table(f"images, {args.image_model}",
                         image_report(args.image_model, args.data_dir, args.n, args.batch)))
    if args.text_model:
        out.append(table(f"reviews, {args.text_model}",
                         text_report(args.text_model, args.data_dir, args.n, args.batch)))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
