"""Which job manager a server runs: local processes, or a Ray cluster
(``VIT_SERVICE_JOBS_EXECUTOR``)."""

from __future__ import annotations

from serving.jobs.manager import JobManager
from vit_service.config import Settings


def create_job_manager(settings: Settings) -> JobManager:
    """The manager for ``settings.jobs_executor``: local processes, or a Ray cluster."""
    if settings.jobs_executor == "ray":
        from serving.jobs.ray_jobs import RayJobManager

        return RayJobManager(settings)
    return JobManager(settings)
