"""Training jobs launched over the API: a persistent queue of `vit-service train` processes."""

from serving.jobs.manager import JobError, JobManager
from serving.jobs.store import JobRecord, JobState, JobStore

__all__ = ["JobError", "JobManager", "JobRecord", "JobState", "JobStore"]
