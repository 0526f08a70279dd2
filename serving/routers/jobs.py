"""Training jobs: launch a known recipe with typed overrides, follow it, cancel, resume.

Every route needs an API key (``Authorization: Bearer <key>``); with no key configured they are
refused (403). The key's principal (its name in ``VIT_SERVICE_API_KEYS``, ``default`` for
``VIT_SERVICE_API_KEY``) owns the jobs it submits: per-key caps count them (docs/jobs.md).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from serving.deps import ApiKeyDep, JsonBodyDep, PrincipalDep, SettingsDep
from serving.errors import error_responses, json_safe
from serving.jobs import JobError, JobManager, JobState
from serving.jobs.schemas import Job, JobCreate, JobList, JobLogs, JobMetrics, Recipe, RecipeList

router = APIRouter(tags=["jobs"], dependencies=[ApiKeyDep],
                   responses=error_responses(401, 403))


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


JobsDep = Annotated[JobManager, Depends(get_jobs)]


@router.get("/recipes", response_model=RecipeList, summary="Recipes a job can run")
def list_recipes() -> RecipeList:
    from training.recipes import list_recipes as _list

    return RecipeList(recipes=[Recipe(name=n, description=d) for n, d in _list().items()])


@router.post("/jobs", response_model=Job, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[JsonBodyDep], responses=error_responses(415, 422, 429),
             summary="Queue a training job")
async def create_job(body: JobCreate, jobs: JobsDep, settings: SettingsDep,
                     owner: PrincipalDep) -> Job:
    job = await run_in_threadpool(jobs.submit, body.recipe, body.overrides, body.name,
                                  body.nprocs, body.priority, owner)
    return job.with_run_url(settings.mlflow_ui_url)


@router.get("/jobs", response_model=JobList, summary="Jobs, newest first")
def list_jobs(jobs: JobsDep, settings: SettingsDep, state: JobState | None = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> JobList:
    return JobList(jobs=[r.with_run_url(settings.mlflow_ui_url)
                         for r in jobs.list(state, limit)])


@router.get("/jobs/{job_id}", response_model=Job, responses=error_responses(404))
def get_job(job_id: str, jobs: JobsDep, settings: SettingsDep) -> Job:
    return jobs.get(job_id).with_run_url(settings.mlflow_ui_url)


@router.get("/jobs/{job_id}/logs", response_model=JobLogs, responses=error_responses(404))
def job_logs(job_id: str, jobs: JobsDep,
             tail: Annotated[int, Query(ge=0, le=10_000)] = 100) -> JobLogs:
    return JobLogs(id=job_id, lines=jobs.logs(job_id, tail))


@router.get("/jobs/{job_id}/metrics", response_model=JobMetrics,
            responses=error_responses(404), summary="Metric series for live curves")
def job_metrics(job_id: str, jobs: JobsDep,
                max_points: Annotated[int, Query(ge=2, le=5000)] = 500) -> JobMetrics:
    return JobMetrics(id=job_id, **jobs.metrics(job_id, max_points))


@router.post("/jobs/{job_id}/cancel", response_model=Job, status_code=status.HTTP_202_ACCEPTED,
             responses=error_responses(404, 409),
             summary="SIGTERM (the trainer checkpoints), SIGKILL after a grace period")
def cancel_job(job_id: str, jobs: JobsDep, settings: SettingsDep) -> Job:
    return jobs.cancel(job_id).with_run_url(settings.mlflow_ui_url)


@router.post("/jobs/{job_id}/resume", response_model=Job, status_code=status.HTTP_202_ACCEPTED,
             responses=error_responses(404, 409, 429),
             summary="Queue a failed or cancelled job again, from its last checkpoint")
def resume_job(job_id: str, jobs: JobsDep, settings: SettingsDep) -> Job:
    return jobs.resume(job_id).with_run_url(settings.mlflow_ui_url)


def install_job_error_handler(app: FastAPI) -> None:
    """``JobError`` -> its status (404 unknown job, 409 wrong state, 422 bad request)."""

    @app.exception_handler(JobError)
    async def _job_error(request: Request, exc: JobError) -> JSONResponse:
        return JSONResponse({"detail": json_safe(exc.detail)}, status_code=exc.status)
