"""Attention-map maths and PNG overlays, one thread, no HTTP; optionally against a git revision.

    python benchmarks/bench_maps.py                         # this tree
    python benchmarks/bench_maps.py --baseline 391d01c      # and the module as it was then
    python benchmarks/bench_maps.py --images DIR            # overlays of real JPEGs too

Timed: ``overlay_heatmap`` (a 32x32 image rendered at 224x224, random noise and, with
``--images``, the first 20 JPEGs under DIR; a 400x300 image kept at its size) and
``compute_attention_maps`` (rollout + per-layer maps of a 6-layer, 4-head, 65-token model,
``query="mean"``) at batch 1, 8 and 32. The baseline is ``vit_service/attention_maps.py`` of
``--baseline`` (``git show``), imported from a temporary file.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from PIL import Image
from timing import ms_per_call  # benchmarks/timing.py (run as a script)

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:vit_service/attention_maps.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "attention_maps_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_maps_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, metavar="REV", help="git revision to compare")
    p.add_argument("--images", type=Path, default=None, help="a folder of JPEGs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from vit_service import attention_maps

    mods = {"now": attention_maps}
    if args.baseline:
        mods[args.baseline] = _module_at(args.baseline)
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
             for _ in range(20)]
    inputs = {"noise 32x32 -> 224": noise,
              "400x300 (kept)": [im.resize((400, 300), Image.BICUBIC) for im in noise[:5]]}
    if args.images is not None:
        files = sorted(args.images.rglob("*.jpg"))[:20]
        inputs["JPEGs 32x32 -> 224"] = [Image.open(f).convert("RGB") for f in files]
    heat = torch.rand(8, 8, generator=torch.Generator().manual_seed(0))
    print("| overlay | " + " | ".join(mods) + " |")
    for name, imgs in inputs.items():
        cells = []
        for mod in mods.values():
            ms = np.mean([ms_per_call(lambda im=im, m=mod: m.overlay_heatmap(im, heat), 3)
                          for im in imgs])
            kb = np.mean([len(mod.overlay_heatmap(im, heat)) for im in imgs]) / 1024
            cells.append(f"{ms:.1f} ms, {kb:.0f} KB")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| maps, batch | " + " | ".join(mods) + " |")
    for b in (1, 8, 32):
        attn = torch.rand(6, b, 4, 65, 65, generator=torch.Generator().manual_seed(b)).softmax(-1)
        cells = []
        for mod in mods.values():
            ms = ms_per_call(
                lambda m=mod, a=attn: m.compute_attention_maps(a, grid=(8, 8), query="mean"),
                30)
            cells.append(f"{ms:.2f} ms")
        print(f"| {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
