"""The served forward of a bundle by precision and form, side by side in one process.

What ``inference_precision: auto`` (vit_service/precision.py, serving/compiled.py) rests on: a
bundle's forward, logits only and with the attention weights, as

* eager fp32 (fused attention), traced fp32 (the served forward before bf16),
* eager bf16 (autocast, explicit attention), traced bf16 (served now on a CPU with native bf16),

at batch ``--batch`` (default 32, the server's largest) with ``--threads`` torch threads, the
configurations timed in alternating rounds so that background load hits them alike; each row is
the median over the rounds and its ratio to the first. An image bundle gets random images, a
text bundle a 200-word review. bf16 rows mean something only on a CPU with ``avx512_bf16`` /
``amx_bf16`` (printed). Accuracy is not measured here: ``vit-service evaluate B --precision
fp32|bf16`` does that.

    .venv/bin/python benchmarks/bench_inference_precision.py --bundle B     # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.compiled import eager_forwards, trace_forwards  # noqa: E402
from vit_service.bundle import load_bundle  # noqa: E402
from vit_service.hardware import cpu_has_native_bf16  # noqa: E402

REVIEW = " ".join(  # ~200 words, as benchmarks/bench_serving.py sends
    ("this film was a pleasant surprise the cast is strong the story moves along and the "
     "ending works even if the middle drags a little at times i would watch it again").split()
    * 7)[:1200]


def inputs_for(bundle_dir: Path, batch: int) -> tuple[torch.nn.Module, str, dict,
                                                      tuple[torch.Tensor, ...]]:
    b = load_bundle(bundle_dir)
    net = b.model.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    if b.meta.task == "image":
        s = int(b.meta.preprocess["image_size"])
        return net, "image", b.meta.preprocess, (torch.randn(batch, 3, s, s),)
    enc = b.tokenizer.encode_batch([REVIEW] * batch, int(b.meta.preprocess["max_len"]),
                                   b.meta.preprocess.get("truncation", "head"))
    return net, "text", b.meta.preprocess, (enc.input_ids, enc.attention_mask)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="an image or text model bundle")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=5, help="forwards per configuration and round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    net, task, pre, x = inputs_for(args.bundle, args.batch)
    forwards = {
        "eager fp32": eager_forwards(net, "fp32"),
        "traced fp32": trace_forwards(net, task, pre, "bench", "fp32"),
        "eager bf16": eager_forwards(net, "bf16"),
        "traced bf16": trace_forwards(net, task, pre, "bench", "bf16"),
    }
    calls: dict[str, Callable[[], object]] = {}
    for name, f in forwards.items():
        if name.startswith("traced") and not f.traced:
            print(f"warning: {name} fell back to eager", file=sys.stderr)
        calls[f"{name} | logits"] = lambda f=f: f.plain(*x)
        calls[f"{name} | + weights"] = lambda f=f: f.with_attention(*x)
    rates: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for fn in calls.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for k, fn in calls.items():
                t = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                rates[k].append(args.batch * args.calls / (time.perf_counter() - t))
    unit = "img/s" if task == "image" else "texts/s"
    print(f"{args.bundle} ({task}), batch {args.batch}, {args.threads} threads, native bf16: "
          f"{cpu_has_native_bf16()}, median of {args.rounds} rounds")
    print(f"| forward | output | {unit} | vs eager fp32 |")
    print("|---|---|---:|---:|")
    base = {out: statistics.median(rates[f"eager fp32 | {out}"]) for out in ("logits",
                                                                                "+ weights")}
    for k, v in rates.items():
        out = k.split(" | ")[1]
        med = statistics.median(v)
        print(f"| {k} | {med:,.0f} | {med / base[out]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
