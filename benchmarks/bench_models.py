"""Forward+backward time of our ViT versus timm's ``VisionTransformer`` of the same configuration.

Both models are built from the same preset, run on the same batch in the same process, timed in
alternation (so machine noise hits both alike), and reported as a ratio (ours / timm; < 1 means
ours is faster). Also prints every preset's parameter count.

    python benchmarks/bench_models.py                       # vit_tiny_patch4_32, batch 128
    python benchmarks/bench_models.py --preset vit_nano_patch4_32 --iters 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import timm
import torch

from vit_service.models import count_parameters, create_model, get_config, list_models


def timm_twin(name: str) -> torch.nn.Module:
    c = get_config(name)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=c.img_size, patch_size=c.patch_size, in_chans=c.in_chans,
        num_classes=c.num_classes, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
        mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, drop_path_rate=c.drop_path_rate,
    )


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="vit_tiny_patch4_32")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    print("preset parameter counts:")
    for name in list_models():
        print(f"  {name:24s} {count_parameters(create_model(name)) / 1e6:8.3f} M")

    torch.manual_seed(0)
    ours = create_model(args.preset).to(args.device).train()
    ref = timm_twin(args.preset).to(args.device).train()
    ours.load_state_dict(ref.state_dict())  # identical weights: identical work
    c = ours.config
    x = torch.randn(args.batch, 3, c.img_size, c.img_size, device=args.device)
    y = torch.randint(0, c.num_classes, (args.batch,), device=args.device)
    for _ in range(args.warmup):
        step_time(ours, x, y), step_time(ref, x, y)
    t_ours, t_ref = [], []
    for _ in range(args.iters):  # alternate so drift affects both equally
        t_ours.append(step_time(ours, x, y))
        t_ref.append(step_time(ref, x, y))
    mo, mr = statistics.median(t_ours), statistics.median(t_ref)
    res = {
        "preset": args.preset, "batch": args.batch, "device": args.device,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "timm": timm.__version__,
        "ours_s": mo, "timm_s": mr, "ratio_ours_over_timm": mo / mr,
        "ours_img_s": args.batch / mo, "timm_img_s": args.batch / mr,
    }
    print(f"\n{args.preset}, batch {args.batch}, {args.device}, {res['threads']} threads, "
          f"median of {args.iters} fwd+bwd steps")
    print(f"  ours : {mo * 1e3:8.1f} ms/step  {args.batch / mo:8.1f} img/s")
    print(f"  timm : {mr * 1e3:8.1f} ms/step  {args.batch / mr:8.1f} img/s")
    print(f"  ratio ours/timm (time): {mo / mr:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
