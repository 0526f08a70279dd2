"""The GPU check: one prepared command that measures the GPU recipes on one accelerator.

Phases (each through the real trainer, ``training.run.prepare_run(...).run()``, with MLflow
off and nothing registered, run folders under ``--home``):

1. CIFAR-10, recipe ``cifar10-vit``: time to 90 % and to 94 % validation accuracy (from the
   per-epoch evaluations; seconds from the start of training, i.e. the trainer's ``start``
   event, and also from the call, data loading included), final and best val accuracy,
   images/s (median of the train-metric windows after the first epoch, which holds
   ``torch.compile``), FLOPs per training image (``torch.utils.flop_counter.FlopCounterMode``
   on one forward + backward of a training batch, bf16 autocast as in training) and model FLOP
   utilisation = FLOPs/image x images/s / peak (``GPU_PEAK_FLOPS``, default 989e12: H200 bf16
   dense).
2. IMDb: masked-LM self-pretraining (``imdb-mlm-pretrain-gpu``: train part + the 50,000
   unlabelled reviews, never val or test), then ``imdb-transformer`` fine-tuned from that run's
   bundle folder (``init.from=<run dir>/bundle``): final val accuracy, times, tokens/s.

Output: the JSON summary as one line on stdout, then a summary table; the same
JSON in ``$OUT/gpu_check.json`` (rewritten after every phase, so a run cut short still leaves
what it measured), the log in ``$OUT/gpu_check.log``, every progress event in
``$OUT/events.jsonl``.

``--dry-run``: the same flow on the CPU with the smoke recipes (``cifar10-smoke``,
``imdb-mlm-smoke``, ``imdb-transformer-finetune-smoke``), for tests and CI; the MFU figure is
then computed against the same GPU peak and means nothing.

    bash benchmarks/gpu_check.sh                          # data in .device/data
    bash benchmarks/gpu_check.sh --dry-run --data-dir DIR
    bash benchmarks/gpu_check.sh --only cifar --cifar-set budget_minutes=3
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_report import (  # noqa: E402
    CIFAR_TARGETS,
    IMDB_TARGET,
    first_event,
    format_table,
    steady_throughput,
    time_to,
)
from training.progress import Progress  # noqa: E402 (no torch import: checked first)

log = logging.getLogger("gpu_check")

H200_BF16_DENSE_FLOPS = 989e12
RECIPES = {
    "gpu": {"cifar": "cifar10-vit", "mlm": "imdb-mlm-pretrain-gpu",
            "finetune": "imdb-transformer"},
    "dry": {"cifar": "cifar10-smoke", "mlm": "imdb-mlm-smoke",
            "finetune": "imdb-transformer-finetune-smoke"},
}
# dry run: CPU, one thread, no attention sheet (seconds, not minutes)
DRY_OVERRIDES = {"device": "cpu", "threads": 1, "attention_samples": 0}
REQUIRED_MODULES = ("torch", "numpy", "PIL", "yaml", "pydantic", "pydantic_settings",
                    "tokenizers")


# ----------------------------------------------------------------------------- events


class Recorder(Progress):
    """A :class:`training.progress.Progress` that keeps every event with its
    ``time.monotonic()`` (and appends it to ``events_file``); start/epoch/end events are also
    echoed to stderr as JSON lines."""

    def __init__(self, phase: str, unit: str, events_file: IO[str] | None) -> None:
        super().__init__(enabled=True, json_lines=True, stream=sys.stderr, unit=unit)
        self.phase, self.events_file = phase, events_file
        self.events: list[dict[str, Any]] = []

    def _emit(self, event: str, **fields: Any) -> None:
        rec = {"t": time.monotonic(), "event": event, **fields}
        self.events.append(rec)
        if self.events_file is not None:
            self.events_file.write(json.dumps({"phase": self.phase, **rec}, default=str) + "\n")
            self.events_file.flush()
        if event in ("start", "end"):  # epochs: the trainer logs them (and events.jsonl)
            super()._emit(event, phase=self.phase, **fields)


def train_flops_per_item(run: Any) -> dict[str, Any]:
    """FLOPs of one forward + backward of a training batch (bf16 autocast when the run uses
    it), per item (image, or real token), on a copy of the trained model; RNG states are
    restored afterwards."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from training.objectives import pretrain_loss
    from training.step import soft_cross_entropy

    task, dev, amp = run.task, run.setup.device, run.setup.execution.dtype
    model = copy.deepcopy(run.model).train()
    devices = [torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        batch = task.train_batch(0, 0)
        with FlopCounterMode(display=False) as counter:
            with torch.autocast(dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
                if task.objective == "classify":
                    loss = soft_cross_entropy(task.forward(model, batch), batch.targets)
                else:
                    loss = pretrain_loss(task, model, batch).float()
            loss.backward()
    total = float(counter.get_total_flops())
    items = max(1, int(batch.n_items))
    return {"flops_per_batch": total, "batch_items": items, "flops_per_item": total / items}


# ----------------------------------------------------------------------------- phases


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args, self.torch = args, torch
        self.dry = args.dry_run
        self.names = RECIPES["dry" if self.dry else "gpu"]
        self.out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        self.home = Path(args.home) if args.home else Path(
            tempfile.mkdtemp(prefix="vit-gpu-check-"))
        cache = args.cache_dir or os.environ.get("VIT_SERVICE_CACHE_DIR") or (
            REPO / ".device" / "cache")
        from vit_service.config import Settings

        self.settings = Settings(home=self.home, cache_dir=Path(cache))
        self.data_dir = Path(args.data_dir)
        self.peak = float(os.environ.get("GPU_PEAK_FLOPS") or H200_BF16_DENSE_FLOPS)
        self.events_file = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.events_file = (self.out_dir / "events.jsonl").open("w")
        self.t0 = time.monotonic()
        cuda = torch.cuda.is_available()
        self.summary: dict[str, Any] = {
            "schema": 1, "dry_run": self.dry, "ok": False,
            "device": {
                "name": torch.cuda.get_device_name(0) if cuda and not self.dry else "cpu",
                "torch": torch.__version__, "cuda": torch.version.cuda,
                "python": platform.python_version(), "host_cpus": os.cpu_count(),
                "peak_flops": self.peak,
                "peak_flops_source": "GPU_PEAK_FLOPS" if os.environ.get("GPU_PEAK_FLOPS")
                else "default (H200 bf16 dense)"},
            "home": str(self.home), "data_dir": str(self.data_dir),
            "targets": {"cifar_val_acc": list(CIFAR_TARGETS), "imdb_val_acc": IMDB_TARGET},
            "cifar": None, "imdb": None, "errors": [],
        }

    # -------------------------------------------------------------- helpers

    def recipe(self, key: str, extra: dict[str, Any]) -> Any:
        from training.recipes import load_recipe, parse_overrides

        overrides: dict[str, Any] = dict(DRY_OVERRIDES) if self.dry else {}
        overrides.update(extra)
        overrides.update(parse_overrides(getattr(self.args, f"{key}_set")))
        return load_recipe(self.names[key], overrides)

    def train(self, phase: str, recipe: Any) -> tuple[Any, Any, Any, float, float]:
        """``prepare_run(...).run()``; returns (run, result, recorder, t_call, t_done)."""
        from training.run import prepare_run

        rec = Recorder(phase, "img" if recipe.task == "image" else "tok", self.events_file)
        log.info("%s: training %s", phase, recipe.name)
        if self.torch.cuda.is_available():
            self.torch.cuda.reset_peak_memory_stats()
        t_call = time.monotonic()
        run = prepare_run(recipe, data_dir=self.data_dir, run_name=f"{phase}-{recipe.name}",
                          register=False, mlflow_enabled=False, settings=self.settings,
                          progress=rec, started_at=t_call)
        result = run.run()
        t_done = time.monotonic()
        log.info("%s: %s at step %d in %.1fs", phase, result.status, result.step, t_done - t_call)
        return run, result, rec, t_call, t_done

    def phase_summary(self, run: Any, result: Any, rec: Any, t_call: float,
                      t_done: float) -> dict[str, Any]:
        ev = rec.events
        start, end = first_event(ev, "start"), first_event(ev, "end")
        t_start = start["t"] if start else t_call
        curve = [{"epoch": e["epoch"] + 1, "step": e["step"], "t": round(e["t"] - t_start, 2),
                  "t_from_call": round(e["t"] - t_call, 2), "val_acc": e.get("val_acc"),
                  "val_loss": e.get("val_loss")} for e in ev if e["event"] == "epoch"]
        t_end = end["t"] if end else t_done
        if end and (not curve or curve[-1]["step"] != result.step) and (
                result.val_acc is not None or result.val_loss is not None):
            # budget mode ends mid-epoch: the trainer's last evaluation is a curve point too
            curve.append({"epoch": round(result.step / max(1, run.setup.steps_per_epoch), 2),
                          "step": result.step, "t": round(t_end - t_start, 2),
                          "t_from_call": round(t_end - t_call, 2), "val_acc": result.val_acc,
                          "val_loss": result.val_loss, "final": True})  # t: after publishing
        accs = [p["val_acc"] for p in curve if p["val_acc"] is not None]
        tput = steady_throughput(ev)
        # read unconditionally so that the CPU dry run exercises the attribute path too
        cuda = run.setup.device.type == "cuda" and self.torch.cuda.is_available()
        out: dict[str, Any] = {
            "recipe": run.recipe.name, "status": result.status, "steps": result.step,
            "epochs": round(result.step / max(1, run.setup.steps_per_epoch), 2),
            "batch_size": run.recipe.batch_size,
            "budget_minutes": run.recipe.budget_minutes,
            "n_train": run.task.n_train, "n_val": run.task.n_val,
            "final_val_acc": result.val_acc, "best_val_acc": max(accs) if accs else None,
            "final_val_loss": result.val_loss,
            "setup_s": round(t_start - t_call, 2),  # data, model, init (no training)
            "train_s": round(t_end - t_start, 2),  # first step to the end event
            "total_s": round(t_done - t_call, 2),  # the whole call
            "throughput_unit": f"{run.task.unit}/s", "throughput": tput,
            "peak_memory_gb": round(self.torch.cuda.max_memory_allocated() / 2**30, 2)
            if cuda else None,
            "curve": curve, "run_dir": str(result.run_dir),
        }
        return out

    def add_flops(self, out: dict[str, Any], run: Any) -> None:
        try:
            f = train_flops_per_item(run)
        except Exception as e:  # a measurement must not lose the phase's results
            log.exception("FLOP count failed")
            out.update(flops_per_item=None, mfu=None, flops_error=repr(e))
            return
        out.update(flops_per_item=f["flops_per_item"], flops_per_batch=f["flops_per_batch"])
        tput = out.get("throughput")
        out["achieved_flops"] = f["flops_per_item"] * tput if tput else None
        out["mfu"] = out["achieved_flops"] / self.peak if tput else None

    def write(self) -> None:
        self.summary["total_s"] = round(time.monotonic() - self.t0, 2)
        if self.out_dir is not None:
            path = self.out_dir / "gpu_check.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
            tmp.replace(path)

    def _error(self, phase: str, e: BaseException) -> None:
        log.exception("%s failed", phase)
        self.summary["errors"].append({"phase": phase, "error": f"{type(e).__name__}: {e}"})

    # -------------------------------------------------------------- phases

    def prepare_data(self) -> None:
        """Decode CIFAR-10 into the cache before the timed run (on a fresh machine the JPEG
        decode would otherwise count as training time)."""
        from vit_service.data import load_cifar10

        t = time.monotonic()
        load_cifar10(self.data_dir, "train", image_size=32, cache_dir=self.settings.cache_dir)
        self.summary["cifar_decode_s"] = round(time.monotonic() - t, 2)

    def cifar(self) -> None:
        recipe = self.recipe("cifar", {})
        run, result, rec, t_call, t_done = self.train("cifar", recipe)
        out = self.phase_summary(run, result, rec, t_call, t_done)
        for th in CIFAR_TARGETS:
            key = f"{round(th * 100)}"
            out[f"time_to_{key}_s"] = time_to(out["curve"], th)
            t_call_curve = [{**p, "t": p["t_from_call"]} for p in out["curve"]]
            out[f"time_to_{key}_s_from_call"] = time_to(t_call_curve, th)
        out["images_per_s"] = out["throughput"]
        self.add_flops(out, run)
        self.summary["cifar"] = out
        del run
        self._free()

    def imdb(self) -> None:
        imdb: dict[str, Any] = {"pretrain": None, "finetune": None}
        self.summary["imdb"] = imdb
        recipe = self.recipe("mlm", {})
        run, result, rec, t_call, t_done = self.train("mlm", recipe)
        pre = self.phase_summary(run, result, rec, t_call, t_done)
        pre["tokens_per_s"] = pre["throughput"]
        self.add_flops(pre, run)
        imdb["pretrain"] = pre
        del run
        self._free()
        self.write()
        if result.status != "finished" and result.status != "stopped":
            raise RuntimeError(f"pretraining ended {result.status}: no encoder to fine-tune")
        bundle = Path(result.run_dir) / "bundle"
        recipe = self.recipe("finetune", {"init.from": str(bundle)})
        run, result, rec, t_call, t_done = self.train("finetune", recipe)
        ft = self.phase_summary(run, result, rec, t_call, t_done)
        ft["init_from"] = str(bundle)
        ft["tokens_per_s"] = ft["throughput"]
        ft["time_to_target_s"] = time_to(ft["curve"], IMDB_TARGET)
        imdb["finetune"] = ft
        imdb["total_s"] = round(pre["total_s"] + ft["total_s"], 2)
        del run
        self._free()

    def _free(self) -> None:
        import gc

        gc.collect()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()

    def main(self) -> int:
        only = self.args.only
        log.info("gpu check: %s, home %s, data %s", "DRY RUN (CPU, smoke recipes)" if self.dry
                 else self.summary["device"]["name"], self.home, self.data_dir)
        steps = [("data", self.prepare_data, only in (None, "cifar")),
                 ("cifar", self.cifar, only in (None, "cifar")),
                 ("imdb", self.imdb, only in (None, "imdb"))]
        for name, fn, wanted in steps:
            if not wanted:
                continue
            try:
                fn()
            except Exception as e:
                self._error(name, e)
            self.write()
        self.summary["ok"] = not self.summary["errors"]
        self.write()
        print(json.dumps(self.summary, default=str))  # the table last: it ends the output
        print(format_table(self.summary))
        if self.events_file is not None:
            self.events_file.close()
        return 0 if self.summary["ok"] else 1


# ----------------------------------------------------------------------------- entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, smoke recipes, seconds (tests and CI)")
    p.add_argument("--data-dir", default=str(REPO / ".device" / "data"),
                   help="folder with cifar10-jpeg-train.tar.gz and aclImdb-train.tar.gz "
                   "(default: .device/data)")
    p.add_argument("--home", help="run folders (default: a new temporary folder)")
    p.add_argument("--cache-dir", help="decoded/tokenised data cache (default: "
                   "$VIT_SERVICE_CACHE_DIR, else .device/cache)")
    p.add_argument("--only", choices=["cifar", "imdb"], help="run one of the two parts")
    for key, what in (("cifar", "the CIFAR-10 recipe"), ("mlm", "the MLM pretraining recipe"),
                      ("finetune", "the IMDb fine-tuning recipe")):
        p.add_argument(f"--{key}-set", action="append", default=[], metavar="KEY=VALUE",
                       help=f"override a key of {what} (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(argv)


def missing_modules() -> list[str]:
    out = []
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(os.environ["OUT"]) / "gpu_check.log"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    missing = missing_modules()
    if missing:
        print(f"error: {sys.executable} lacks {', '.join(missing)} (the check installs "
              "nothing; set PYTHON to an interpreter that has the project's dependencies)",
              file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch (use --dry-run for the CPU flow)",
              file=sys.stderr)
        return 2
    if not Path(args.data_dir).exists():
        print(f"error: data folder {args.data_dir} not found (expected "
              "cifar10-jpeg-train.tar.gz and aclImdb-train.tar.gz in it)", file=sys.stderr)
        return 2
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
