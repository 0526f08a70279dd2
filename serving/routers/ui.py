"""The web page (static files, no build step) and the small info route it reads."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from serving.deps import SettingsDep
from vit_service import __version__

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["ui"])


class Info(BaseModel):
    version: str
    mlflow_ui_url: str | None
    api_key_configured: bool


@router.get("/v1/info", response_model=Info, summary="Service version and the MLflow UI link")
def info(settings: SettingsDep) -> Info:
    return Info(version=__version__, mlflow_ui_url=settings.mlflow_ui_url,
                api_key_configured=settings.api_key is not None)


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html")


def mount_ui(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
