"""Eager vs traced serving forwards, alone and beside a thread that runs Python (the GIL).

    python benchmarks/bench_traced.py --bundle path/to/bundle [--batch 8]

One torch thread, as a ``serve --workers N`` worker has. The "busy" thread imitates an event
loop under load: Python work in 1 ms bursts with 1 ms pauses. Eager PyTorch takes the GIL back
after every op, so it waits for that thread; a TorchScript trace runs its ops in C++
(``serving/compiled.py``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
from timing import ms_per_call  # benchmarks/timing.py (run as a script)


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.001:
            sum(range(200))
        time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="an image model bundle")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    from serving.compiled import trace_forwards
    from vit_service.bundle import load_bundle

    torch.set_num_threads(1)
    b = load_bundle(args.bundle)
    net = b.model.eval()
    for q in net.parameters():
        q.requires_grad_(False)
    traced = trace_forwards(net, b.meta.task, b.meta.preprocess)
    size = int(b.meta.preprocess["image_size"])
    x = torch.randn(args.batch, 3, size, size)
    fns = {"eager fused": lambda: net(x), "eager attention": lambda: net.forward_with_attention(x),
           "traced fused": lambda: traced.plain(x),
           "traced attention": lambda: traced.with_attention(x)}
    print(f"| batch {args.batch}, ms | " + " | ".join(fns) + " |")
    with torch.inference_mode():
        for mode in ("alone", "beside a busy Python thread"):
            stop = threading.Event()
            th = threading.Thread(target=_busy, args=(stop,), daemon=True)
            if mode != "alone":
                th.start()
            cells = [f"{ms_per_call(f, 30, warmup=3):.1f}" for f in fns.values()]
            print(f"| {mode} | " + " | ".join(cells) + " |")
            stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
