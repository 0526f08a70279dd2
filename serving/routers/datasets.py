"""Users' data sets: upload (checked while it is kept, see :mod:`vit_service.data.datasets`),
list, show, delete. Every route needs the API key; an upload's body is capped by
``max_dataset_bytes`` while it streams to disk, and a refused upload leaves nothing behind.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from serving.deps import ApiKeyDep
from serving.errors import InvalidRequestError, UnsupportedMediaTypeError, error_responses
from serving.jobs import JobManager, JobState
from vit_service.data.datasets import DatasetInfo, DatasetStore
from vit_service.data.upload_checks import DatasetError

UPLOAD_TYPES = ("application/zip", "application/gzip", "application/x-gzip",
                "application/x-tar", "text/csv", "application/x-ndjson", "application/jsonl",
                "application/json", "application/octet-stream")

router = APIRouter(tags=["datasets"], dependencies=[ApiKeyDep],
                   responses=error_responses(401, 403))


class Dataset(BaseModel):
    """An uploaded data set (``counts``: split -> class -> examples)."""

    id: str
    kind: str
    format: str
    filename: str
    sha256: str
    bytes: int
    classes: list[str]
    counts: dict[str, dict[str, int]]
    stats: dict[str, Any]
    created_at: float


class DatasetList(BaseModel):
    datasets: list[Dataset]


def get_datasets(request: Request) -> DatasetStore:
    return request.app.state.datasets


DatasetsDep = Annotated[DatasetStore, Depends(get_datasets)]


def _schema(info: DatasetInfo) -> Dataset:
    return Dataset(**info.to_dict())


def _known(store: DatasetStore, dataset_id: str) -> DatasetInfo:
    try:
        return store.get(dataset_id)
    except KeyError:
        raise DatasetNotFoundError(dataset_id) from None


class DatasetNotFoundError(HTTPException):
    def __init__(self, dataset_id: str) -> None:
        super().__init__(status.HTTP_404_NOT_FOUND, f"unknown data set {dataset_id!r}")


@router.post("/datasets", response_model=Dataset, status_code=status.HTTP_201_CREATED,
             responses=error_responses(413, 415, 422), summary="Upload a data set")
async def upload_dataset(
    request: Request, response: Response, store: DatasetsDep,
    name: Annotated[str, Query(max_length=200, description="the file's name (its extension "
                                                           "tells a CSV from JSON Lines)")] = "",
) -> Dataset:
    """The raw file as the body: an ImageFolder ``.zip`` / ``.tar.gz`` or a ``.csv`` /
    ``.jsonl`` table with ``text`` and ``label``. 201 with what it holds; 200 when the same
    bytes were uploaded before; 422 naming the member or line that is wrong."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in UPLOAD_TYPES:
        raise UnsupportedMediaTypeError(ctype, list(UPLOAD_TYPES))
    store.root.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".upload-", dir=store.root)
    tmp = Path(tmp_name)
    try:
        with open(fd, "wb") as f:
            async for chunk in request.stream():  # capped by the body-size middleware
                f.write(chunk)
        info, new = await run_in_threadpool(store.add, tmp, name or "upload")
    except DatasetError as e:
        raise InvalidRequestError(str(e)) from None
    finally:
        tmp.unlink(missing_ok=True)
    if not new:
        response.status_code = status.HTTP_200_OK
    return _schema(info)


@router.get("/datasets", response_model=DatasetList, summary="Data sets, newest first")
def list_datasets(store: DatasetsDep) -> DatasetList:
    return DatasetList(datasets=[_schema(d) for d in store.list()])


@router.get("/datasets/{dataset_id}", response_model=Dataset, responses=error_responses(404),
            summary="One data set")
def get_dataset(dataset_id: str, store: DatasetsDep) -> Dataset:
    return _schema(_known(store, dataset_id))


@router.delete("/datasets/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=error_responses(404, 409), summary="Delete a data set")
def delete_dataset(dataset_id: str, request: Request, store: DatasetsDep) -> Response:
    """Refused (409) while a queued or running job names it in its overrides."""
    _known(store, dataset_id)
    jobs: JobManager = request.app.state.jobs
    users = [j.id for state in (JobState.queued, JobState.running)
             for j in jobs.list(state) if dataset_id in map(str, j.overrides.values())]
    if users:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"data set {dataset_id} is used by job(s) {', '.join(users)}")
    store.delete(dataset_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
