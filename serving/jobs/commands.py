"""The command lines a job runs: the trainer, and (on Ray) the node's pre-flight check first.

Built from a job's validated recipe name and typed overrides only, never from a user string.
"""

from __future__ import annotations

from typing import Any

from serving.jobs.model import Job
from training.progress import Event
from training.recipes import setting_text


def train_command(job: Job, python: str, resume: str | None) -> list[str]:
    """The ``vit-service train`` command line of ``job``: built from its validated recipe name
    and typed overrides only (never a user string), under torchrun when it asks >1 process.
    ``resume``: None (start afresh), ``auto`` (the run's checkpoint: the recipe comes from it)
    or ``if-exists`` (the checkpoint if there is one, else afresh with the overrides)."""
    train = ["-m", "vit_service.cli", "train", job.recipe, "--run-name", f"job-{job.id}"]
    if resume is not None:
        train += ["--resume", resume]
    if resume != "auto":
        for key, value in job.overrides.items():
            train += ["--set", _setting(key, value)]
    if job.nprocs > 1:
        return [python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={job.nprocs}", *train]
    return [python, *train]


def ray_train_command(job: Job, python: str, *, storage: str, cpus_per_worker: float,
                      gpus_per_worker: float, max_failures: int, placement: str) -> list[str]:
    """The Ray Train driver of a job with ``nprocs`` > 1 on a Ray cluster: ``nprocs`` workers,
    wherever the cluster places them (:mod:`training.ray_train`). Built like
    :func:`train_command`, from the validated recipe name and typed overrides only."""
    cmd = [python, "-m", "training.ray_train", job.recipe, "--run-name", f"job-{job.id}",
           "--workers", str(job.nprocs), "--cpus-per-worker", f"{cpus_per_worker:g}",
           "--gpus-per-worker", f"{gpus_per_worker:g}", "--storage", storage,
           "--max-failures", str(max_failures), "--placement", placement]
    for key, value in job.overrides.items():
        cmd += ["--set", _setting(key, value)]
    return cmd


def _setting(key: str, value: Any) -> str:
    """``key=<text>`` that the trainer reads back as the job's typed value, exactly as its
    submission validated it (:func:`training.recipes.setting_text`)."""
    return f"{key}={setting_text(value)}"


# Run by the job's interpreter before the trainer (standard library only: it must run where
# nothing else imports): one JSON event and exit code 78 (EX_CONFIG) when the node's
# interpreter lacks what a training job imports.
PREFLIGHT = (
    "import importlib.util as u, json, socket, sys\n"
    "missing = [m for m in ('torch', 'vit_service', 'training') if u.find_spec(m) is None]\n"
    "if missing:\n"
    f"    print(json.dumps({{'event': '{Event.preflight}', 'status': 'failed', 'reason': "
    "f'{sys.executable} on {socket.gethostname()} cannot import {\", \".join(missing)}: set "
    "VIT_SERVICE_RAY_PYTHON to the interpreter of the nodes that has vit-service installed'}),"
    " flush=True)\n"
    "    sys.exit(78)\n"
)


def preflight_command(python: str) -> list[str]:
    """The pre-flight check of a node's interpreter (:data:`PREFLIGHT`) as a command line."""
    return [python, "-c", PREFLIGHT]
