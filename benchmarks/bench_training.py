"""Training throughput: our trainer's step vs. timm + a torchvision DataLoader pipeline.

Ours: the project's ViT, the whole uint8 training set resident on the device, batches cut by
index, crop/flip/normalise batched on the device (``training.tasks.ImageTask``), and the
trainer's own ``train_step`` (soft-target CE, AdamW with decay groups).

Baseline: timm's ``VisionTransformer`` of the same configuration trained with a standard
``DataLoader`` over PIL images (``RandomCrop(32, padding=4)``, ``RandomHorizontalFlip``,
``ToTensor``, ``Normalize``), ``num_workers`` as a flag, plain AdamW and cross-entropy.

Both: same batch size, same number of timed steps after the same warm-up, same process, timed in
alternating blocks of steps so that both see the same background load (the baseline's workers
run only during its own blocks). "data frac" is the share
of the timed wall-clock spent waiting for the next batch.

    .venv/bin/python benchmarks/bench_training.py                      # synthetic CIFAR arrays
    .venv/bin/python benchmarks/bench_training.py --data-dir /work/shared/data --num-workers 2
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.distributed import DistInfo, resolve_device  # noqa: E402
from training.model_setup import build_task_model  # noqa: E402
from training.optim import param_groups  # noqa: E402
from training.recipes import load_recipe  # noqa: E402
from training.step import train_step  # noqa: E402
from training.tasks import ImageTask  # noqa: E402
from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD  # noqa: E402
from vit_service.data import CIFAR10_CLASSES, ImageDataset, load_cifar10  # noqa: E402
from vit_service.models import get_config  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OursRunner:
    """Our trainer's step: resident uint8 data, on-device augmentation, ``train_step``."""

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def __init__(self, ds: ImageDataset, args: argparse.Namespace, device: torch.device) -> None:
        recipe = load_recipe("cifar10-vit-cpu", {
            "model.name": args.preset, "model.pos_encoding": "learned", "model.overrides": {},
            "batch_size": args.batch_size, "data.val_size": 100, "data.subset": None,
            "augment.cutmix_prob": args.cutmix, "augment.mixup_alpha": 0.0,
            "augment.randaugment_ops": 0, "optim.ema_decay": None, "optim.grad_clip": None,
            "device": device.type})
        self.task = ImageTask(recipe, DistInfo(device=device), None, dataset=ds)
        torch.manual_seed(0)
        self.model = build_task_model(recipe, self.task).to(device).train()
        self.opt = torch.optim.AdamW(param_groups(self.model, 0.05), lr=1e-3)
        self.amp = torch.bfloat16 if (device.type == "cuda" and args.amp) else None
        self.i = 0

    def step(self) -> float:
        """One training step; returns the seconds spent getting the batch."""
        spe = self.task.steps_per_epoch()
        t0 = time.perf_counter()
        batch = self.task.train_batch(self.i // spe, self.i % spe)
        t_data = time.perf_counter() - t0
        train_step(self.model, self.model, self.task, batch, self.opt, None, self.amp)
        self.i += 1
        return t_data


class _PILDataset(torch.utils.data.Dataset):
    """torchvision-CIFAR10 style: a PIL image per item, then the transform."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


class TimmRunner:
    """timm ``VisionTransformer`` + torchvision transforms + ``DataLoader``."""

    def __init__(self, ds: ImageDataset, args: argparse.Namespace, device: torch.device) -> None:
        import timm.models.vision_transformer as tv
        from torchvision import transforms as T

        c = get_config(args.preset)
        torch.manual_seed(0)
        self.model = tv.VisionTransformer(
            img_size=c.img_size, patch_size=c.patch_size, num_classes=10,
            embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads, mlp_ratio=c.mlp_ratio,
            qkv_bias=c.qkv_bias, drop_path_rate=c.drop_path_rate, global_pool="token",
            class_token=True,
        ).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.05)
        tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize(CIFAR10_MEAN, CIFAR10_STD)])
        self.loader = torch.utils.data.DataLoader(
            _PILDataset(ds.images, ds.labels, tf), batch_size=args.batch_size, shuffle=True,
            num_workers=args.num_workers, drop_last=True, pin_memory=device.type == "cuda")
        self.amp = device.type == "cuda" and args.amp
        self.device = device
        self.it = None

    def begin(self) -> None:
        self.it = iter(self.loader)  # (re)starts the workers; their start-up counts as data

    def end(self) -> None:
        self.it = None  # stop prefetching while the other pipeline runs (same cores)

    def step(self) -> float:
        t0 = time.perf_counter()
        if self.it is None:
            self.begin()
        try:
            x, y = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            x, y = next(self.it)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t_data = time.perf_counter() - t0
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self.model(x).float(), y, label_smoothing=0.1)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return t_data


def run(runners: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """Warm up each pipeline, then time them in alternating blocks of ``args.block`` steps, so
    that both see the same background load (this machine is shared). A DataLoader's workers are
    started at the beginning of each of its blocks and stopped at the end (as at an epoch
    boundary), so they neither prefetch on the other pipeline's time nor hide their start-up."""
    for r in runners.values():
        for _ in range(args.warmup):
            r.step()
        r.end()
    stats = {k: {"wall": 0.0, "data": 0.0, "steps": 0} for k in runners}
    while any(s["steps"] < args.steps for s in stats.values()):
        for k, r in runners.items():
            n = min(args.block, args.steps - stats[k]["steps"])
            if n <= 0:
                continue
            _sync(device)
            t0 = time.perf_counter()
            r.begin()
            data = sum(r.step() for _ in range(n))
            _sync(device)
            stats[k]["wall"] += time.perf_counter() - t0
            r.end()
            stats[k]["data"] += data
            stats[k]["steps"] += n
    return {k: {"img_s": s["steps"] * args.batch_size / s["wall"],
                "data_frac": s["data"] / s["wall"], "wall_s": s["wall"]}
            for k, s in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="vit_nano_patch4_32")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--block", type=int, default=10, help="steps per turn when alternating")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--num-workers", type=int, default=2, help="baseline DataLoader workers")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--data-dir", help="CIFAR-10 source (default: synthetic arrays)")
    ap.add_argument("--n-images", type=int, default=10000, help="synthetic set size")
    ap.add_argument("--cutmix", type=float, default=0.0, help="ours: CutMix probability")
    ap.add_argument("--no-amp", dest="amp", action="store_false", help="CUDA: fp32")
    ap.add_argument("--only", choices=["ours", "timm"], help="run one side only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.data_dir:
        ds = load_cifar10(args.data_dir, "train")
    else:
        rng = np.random.default_rng(0)
        ds = ImageDataset(rng.integers(0, 256, (args.n_images, 32, 32, 3), dtype=np.uint8),
                          rng.integers(0, 10, args.n_images), list(CIFAR10_CLASSES))
    print(f"preset {args.preset}, batch {args.batch_size}, {args.steps} timed steps after "
          f"{args.warmup}, device {device}, torch threads {torch.get_num_threads()}, "
          f"baseline num_workers {args.num_workers}, {len(ds)} images")
    runners = {}
    if args.only in (None, "ours"):
        runners["ours"] = OursRunner(ds, args, device)
    if args.only in (None, "timm"):
        runners["timm+DataLoader"] = TimmRunner(ds, args, device)
    res = run(runners, args, device)
    print(f"{'pipeline':<18}{'img/s':>10}{'data frac':>11}{'wall s':>9}")
    for k, v in res.items():
        print(f"{k:<18}{v['img_s']:>10.1f}{v['data_frac']:>11.3f}{v['wall_s']:>9.1f}")
    if len(res) == 2:
        ratio = res["ours"]["img_s"] / res["timm+DataLoader"]["img_s"]
        print(f"speed-up ours / timm+DataLoader: {ratio:.2f}x")


if __name__ == "__main__":
    main()
