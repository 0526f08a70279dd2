"""One training run over several Ray Train workers, which may sit on different nodes.

A job with ``nprocs > 1`` on the Ray executor runs this module as its Ray job's entrypoint
(the driver)::

    python -m training.ray_train cifar10-vit --run-name job-ab12 --workers 4 \\
        --storage /shared/ray-train --max-failures 2 --set epochs=30

The driver builds a ``TorchTrainer`` (Ray Train v2) with ``ScalingConfig(num_workers=N)``; Ray
places the N workers where the cluster has room (``--placement``), starts the process group
(Gloo on the CPU, NCCL on GPUs) and sets torchrun's variables (``RANK``, ``WORLD_SIZE``...),
so each worker runs the same :func:`training.run.train` as a ``torchrun`` rank: the same
validated recipe, rank 0 logs to MLflow, checkpoints and registers.

**Checkpoints go through Ray's storage.** Every checkpoint the trainer writes (each
``checkpoint_every`` epochs, on a stop, at the end) is reported with ``ray.train.report`` and
copied into ``<storage>/<run name>/``: a folder every node mounts, or an ``s3://`` / ``gs://``
URI. When a worker or its node dies, Ray Train restarts the whole group (``--max-failures``
times) and each new worker starts from the latest reported checkpoint, wherever it lands. A
later attempt of the same job (``POST /v1/jobs/{id}/resume``) uses the same run name and
storage, so Ray hands it the same latest checkpoint.

**A cancel checkpoints.** ``ray job stop`` (the jobs API's cancel) sends SIGTERM to the driver
only; the driver writes a stop marker into the storage, every worker watches for it and stops
its run as a SIGTERM would stop a local one (after the current step, with a checkpoint that Ray
keeps), so a resumed job continues from there.

**What the job log shows.** Besides the trainer's progress lines (rank 0's), each worker prints
``cluster`` events: ``ready`` (placed: its rank, node id, host, pid, the attempt), ``first_step``
and ``checkpoint``; the driver prints ``submitted``, ``restarted`` and ``finished``. The job
page and docs/jobs.md's timelines are read from them. The run's MLflow tags record the node ids
and hosts of its last attempt (``vit_service.ray.*``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from training.progress import Event, Progress

log = logging.getLogger(__name__)

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
STOP_MARKER = "vit-service-stop"  # in <storage>/<run name>/ while the driver asks to stop
WATCH_S = 1.0  # how often each worker looks for it


class StopMarker:
    """The driver's stop request, a file in Ray Train's storage (a shared folder or a bucket:
    whatever the workers already reach), read through pyarrow's filesystems as Ray's own
    storage is."""

    def __init__(self, storage: str, run_name: str) -> None:
        from pyarrow import fs

        self.fs, root = fs.FileSystem.from_uri(storage)
        self.path = f"{root.rstrip('/')}/{run_name}/{STOP_MARKER}"

    def set(self) -> None:
        self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(self.path) as f:
            f.write(b"stop")

    def clear(self) -> None:
        if self.is_set():
            self.fs.delete_file(self.path)

    def is_set(self) -> bool:
        from pyarrow import fs

        return self.fs.get_file_info(self.path).type != fs.FileType.NotFound


def _watch_for_stop(marker: StopMarker, done: threading.Event) -> None:
    """A worker's watcher: the driver's stop request becomes this process's SIGTERM."""
    from training.signals import request_stop

    while not done.wait(WATCH_S):
        try:
            if marker.is_set():
                request_stop(signal.SIGTERM)
                return
        except OSError as e:  # storage briefly unreachable: look again
            log.warning("stop marker %s unreadable: %s", marker.path, e)


def cluster_event(phase: str, **fields: Any) -> None:
    """One ``cluster`` progress line on stdout (Ray forwards workers' stdout to the job log)."""
    rec = {"event": Event.cluster.value, "phase": phase, "time": round(time.time(), 3),
           **fields}
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


class _WorkerProgress(Progress):
    """The trainer's progress, plus one ``first_step`` cluster event from every rank (the
    others' progress is silent)."""

    def __init__(self, rank: int, attempt: int, unit: str = "img") -> None:
        super().__init__(enabled=True, json_lines=True, unit=unit)
        self.rank, self.attempt, self._stepped = rank, attempt, False

    def step(self, step: int, epoch: int, **metrics: Any) -> None:
        if not self._stepped:
            self._stepped = True
            cluster_event("first_step", rank=self.rank, at_step=step, attempt=self.attempt)
        super().step(step, epoch, **metrics)


def _attempt_marker(storage: str, run_name: str) -> int:
    """This group's attempt number within the job (1 for the first start; a restart after a
    failure, or a resumed job, counts on): a counter file rank 0 bumps beside the trainer's
    checkpoints. Only for the timeline: nothing depends on it."""
    path = Path(tempfile.gettempdir()) / f"vit-service-ray-{run_name}.attempts"
    if "://" not in storage:
        path = Path(storage) / run_name / "vit-service-attempts"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        n = int(path.read_text() or 0) + 1 if path.exists() else 1
        path.write_text(str(n))
        return n
    except (OSError, ValueError):
        return 0


def _worker_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: the trainer, from Ray's latest checkpoint if any."""
    import ray
    import ray.train
    import torch.distributed as dist

    from training.recipes import load_recipe
    from training.run import train
    from vit_service.config import get_settings

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    me = {"rank": rank, "node_id": node_id, "host": socket.gethostname(), "pid": os.getpid()}
    box = [_attempt_marker(config["storage"], config["run_name"]) if rank == 0 else 0]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    attempt = box[0]
    cluster_event("ready", world_size=world, attempt=attempt, **me)

    settings = get_settings()
    resume: Path | None = None
    latest = ray.train.get_checkpoint()
    local = Path(tempfile.mkdtemp(prefix=f"ray-ckpt-r{rank}-"))  # removed at the end
    if latest is not None:  # a restart, or a resumed job: Ray's latest checkpoint
        with latest.as_directory() as d:
            shutil.copy2(Path(d) / "last.pt", local / "last.pt")
            step = json.loads((Path(d) / "step.json").read_text())["step"]
        resume = local / "last.pt"
        cluster_event("restored", rank=rank, attempt=attempt, at_step=step,
                      checkpoint=latest.path)

    workers: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(workers, me)
    else:
        workers = [me]

    def report(path: Path | None, step: int) -> None:
        """Every rank reports (Ray Train expects each worker's report); rank 0 hands over
        the trainer's checkpoint, copied into a folder of its own."""
        from ray.train import Checkpoint

        if path is None:
            ray.train.report({"step": step}, checkpoint=None)
            return
        with tempfile.TemporaryDirectory(prefix="ray-report-") as d:
            shutil.copy2(path, Path(d) / "last.pt")
            (Path(d) / "step.json").write_text(json.dumps({"step": step}))
            ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        cluster_event("checkpoint", rank=rank, at_step=step, attempt=attempt)

    from training.signals import EXIT_SIGTERM, clear_requested_stop

    clear_requested_stop()
    done = threading.Event()
    threading.Thread(target=_watch_for_stop, daemon=True, name="stop-watch",
                     args=(StopMarker(config["storage"], config["run_name"]), done)).start()
    recipe = load_recipe(config["recipe"], config["overrides"])
    try:
        result = train(recipe, data_dir=config.get("data_dir") or settings.data_dir,
                       run_name=config["run_name"], resume=resume, settings=settings,
                       register=config.get("register", True), on_checkpoint=report,
                       progress=_WorkerProgress(rank, attempt))
    finally:
        done.set()
        shutil.rmtree(local, ignore_errors=True)
    if rank == 0 and result.mlflow_run_id:
        try:
            _tag_run(result.mlflow_run_id, workers, attempt)
        except Exception as e:  # noqa: BLE001 (the run itself is done: not worth a restart)
            log.warning("could not tag MLflow run %s with its nodes: %s",
                        result.mlflow_run_id, e)
    if result.exit_code == EXIT_SIGTERM:  # the driver's stop: checkpointed, not a failure
        cluster_event("stopped", rank=rank, at_step=result.step, attempt=attempt)
        return
    if result.exit_code:
        raise RuntimeError(f"rank {rank}: training ended with exit code {result.exit_code} "
                           f"({result.status})")


def _tag_run(run_id: str, workers: list[dict[str, Any]], attempt: int) -> None:
    """Where the run's last attempt ran, on its MLflow run (tags: a resumed run may change)."""
    from mlflow import MlflowClient

    client = MlflowClient()
    tags = {"vit_service.ray.world_size": str(len(workers)),
            "vit_service.ray.node_ids": ",".join(w["node_id"] for w in workers),
            "vit_service.ray.hosts": ",".join(w["host"] for w in workers),
            "vit_service.ray.nodes": str(len({w["node_id"] for w in workers})),
            "vit_service.ray.attempt": str(attempt)}
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.ray_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--run-name", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="a recipe override (repeatable)")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--storage", required=True,
                   help="Ray Train's storage_path: a folder every node sees, or a URI")
    p.add_argument("--max-failures", type=int, default=2)
    p.add_argument("--placement", choices=PLACEMENTS, default="PACK")
    p.add_argument("--no-register", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from training.recipes import RecipeError, load_recipe, parse_overrides

    try:
        overrides = parse_overrides(args.overrides)
        load_recipe(args.recipe, overrides)  # fail here, before any worker starts
    except (RecipeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker:
        resources["GPU"] = args.gpus_per_worker
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"recipe": args.recipe, "overrides": overrides,
                           "run_name": args.run_name, "storage": args.storage,
                           "register": not args.no_register},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus_per_worker > 0,
                                     resources_per_worker=resources,
                                     placement_strategy=args.placement),
        run_config=RunConfig(name=args.run_name, storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    marker = StopMarker(args.storage, args.run_name)
    marker.clear()  # an earlier attempt's (a cancelled job now resumed)
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        """The job's cancel: ask the workers to checkpoint and stop (Ray SIGKILLs us after
        its grace, RAY_JOB_STOP_WAIT_TIME_S)."""
        if stopping:
            return
        log.warning("%s: asking the workers to stop", signal.Signals(signum).name)
        try:
            marker.set()
        except OSError as e:  # storage unreachable: a second signal tries again
            log.error("could not write the stop marker %s: %s", marker.path, e)
            return
        stopping.append(signum)
        cluster_event("stopping")

    ray.init()  # the Ray job's own cluster (RAY_ADDRESS), or a local one when run by hand
    # after ray.init(), which installs a handler of its own that exits at once
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    cluster_event("submitted", workers=args.workers, resources_per_worker=resources,
                  placement=args.placement, storage=args.storage,
                  max_failures=args.max_failures, ray_nodes=len(alive))
    try:
        result = trainer.fit()
    except Exception as e:  # Ray's TrainingFailedError: the last worker error, after retries
        cluster_event("failed", error=str(e)[-2000:])
        log.error("training failed after %d restart(s) at most: %s", args.max_failures, e)
        return 1
    ckpt = result.checkpoint.path if result.checkpoint else None
    if stopping:
        cluster_event("stopped", checkpoint=ckpt)
        return 143 if stopping[0] == signal.SIGTERM else 130
    cluster_event("finished", checkpoint=ckpt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
