"""Training jobs launched over the API: a persistent queue of `vit-service train` runs, executed
as local processes (``manager``) or on a Ray cluster (``ray_jobs``)."""

from serving.jobs.factory import create_job_manager
from serving.jobs.manager import JobError, JobManager
from serving.jobs.store import JobRecord, JobState, JobStore

__all__ = ["JobError", "JobManager", "JobRecord", "JobState", "JobStore", "create_job_manager"]
