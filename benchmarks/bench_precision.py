"""CPU training step by precision and attention path, side by side in one process.

What ``cpu_bf16`` and ``attention: auto`` (training/step.py) rest on: the training step of a
recipe's model (default ``cifar10-vit-cpu``: vit_nano, 50 % patch dropout, batch 128) under

* fused fp32 (the former CPU default), fused bf16, explicit fp32, explicit bf16 (the new
  default on a CPU with native bf16), at each image size the recipe trains (32 px, and 16 px
  for its progressive-resizing stage);
* and the validation forward (eval mode, flip TTA, fp32) on the fused and the explicit path.

The configurations are timed in alternating rounds (``--rounds`` x ``--steps``), so background
load hits them alike; the table gives each one's median over the rounds and its ratio to the
first row. bf16 rows are meaningful only on a CPU with ``avx512_bf16`` / ``amx_bf16`` (printed).

    .venv/bin/python benchmarks/bench_precision.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_precision.py --recipe cifar10-vit-convstem-cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.recipes import load_recipe  # noqa: E402
from training.step import soft_cross_entropy  # noqa: E402
from vit_service.hardware import cpu_has_native_bf16  # noqa: E402
from vit_service.models import create_model  # noqa: E402
from vit_service.models.layers import set_fused_attn  # noqa: E402

CONFIGS = [("fused", None), ("fused", torch.bfloat16), ("explicit", None),
           ("explicit", torch.bfloat16)]


def build(recipe_name: str, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    r = load_recipe(recipe_name)
    torch.manual_seed(0)
    model = create_model(r.model.name, pos_encoding=r.model.pos_encoding, **r.model.overrides)
    set_fused_attn(model, fused)
    return model.train(), torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_rates(recipe_name: str, size: int, batch: int, steps: int, rounds: int
                ) -> list[tuple[str, float]]:
    x = torch.randn(batch, 3, size, size)
    y = F.one_hot(torch.randint(0, 10, (batch,)), 10).float()
    runners = []
    for path, dtype in CONFIGS:
        model, opt = build(recipe_name, path == "fused")

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                 dtype: torch.dtype | None = dtype) -> None:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = model(x)
            soft_cross_entropy(logits, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        runners.append((f"{path} {'bf16' if dtype else 'fp32'}", step))
    rates: dict[str, list[float]] = {name: [] for name, _ in runners}
    for _ in range(rounds):
        for name, step in runners:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            rates[name].append(batch * steps / (time.perf_counter() - t0))
    return [(name, statistics.median(v)) for name, v in rates.items()]


def eval_rates(recipe_name: str, batch: int, rounds: int) -> list[tuple[str, float]]:
    x = torch.randn(batch, 3, 32, 32)
    models = []
    for fused in (True, False):
        model, _ = build(recipe_name, fused)
        models.append(("fused fp32" if fused else "explicit fp32", model.eval()))
    rates: dict[str, list[float]] = {name: [] for name, _ in models}
    with torch.inference_mode():
        for _, model in models:
            model(x)
        for _ in range(rounds):
            for name, model in models:
                t0 = time.perf_counter()
                for _ in range(2):
                    model(x)
                rates[name].append(2 * batch / (time.perf_counter() - t0))
    return [(name, statistics.median(v)) for name, v in rates.items()]


def table(title: str, rows: list[tuple[str, float]]) -> None:
    print(f"\n{title}\n| path, precision | img/s (median) | vs first row |\n| --- | ---: | ---: |")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} | {rate / rows[0][1]:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="cifar10-vit-cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    r = load_recipe(a.recipe)
    sizes = [32] + sorted({s for _, s in (r.augment.resolution_schedule or [])}, reverse=True)
    print(f"recipe {a.recipe}, model {r.model.name}, batch {a.batch}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}, "
          f"load average before: {os.getloadavg()[0]:.2f}")
    for size in sizes:
        table(f"training step at {size} px", train_rates(a.recipe, size, a.batch, a.steps,
                                                         a.rounds))
    table("validation forward (eval mode, fp32, batch 500)", eval_rates(a.recipe, 500, a.rounds))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
