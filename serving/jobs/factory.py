"""Which executor a server's job manager launches through: local processes, or a Ray cluster
(``VIT_SERVICE_JOBS_EXECUTOR``)."""

from __future__ import annotations

from serving.jobs.executor import Executor
from serving.jobs.local import LocalExecutor
from serving.jobs.manager import JobManager
from vit_service.config import Settings


def create_executor(settings: Settings) -> Executor:
    """The executor for ``settings.jobs_executor``: local processes, or a Ray cluster."""
    if settings.jobs_executor == "ray":
        from serving.jobs.ray_jobs import RayExecutor

        return RayExecutor(settings)
    return LocalExecutor(settings)


def create_job_manager(settings: Settings) -> JobManager:
    return JobManager(settings, executor=create_executor(settings))
