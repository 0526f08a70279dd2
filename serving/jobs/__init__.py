"""Training jobs launched over the API: a persistent queue of `vit-service train` runs
(``manager``), executed as local processes (``local``) or on a Ray cluster (``ray_jobs``)."""

from serving.jobs.factory import create_executor, create_job_manager
from serving.jobs.manager import JobManager
from serving.jobs.model import Job, JobError, JobState
from serving.jobs.store import JobStore

__all__ = ["Job", "JobError", "JobManager", "JobState", "JobStore", "create_executor",
           "create_job_manager"]
