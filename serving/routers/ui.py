"""The web page (static files, no build step) and the small info route it reads."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
                api_key_configured=bool(settings.principals))


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/docs", include_in_schema=False)
def docs() -> HTMLResponse:
    """Swagger UI from this server's own copy of its assets (swagger-ui-bundle), no CDN: the
    page works offline and the Content-Security-Policy can stay at 'self'."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title="vit-service API",
                               swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                               swagger_css_url="/docs-assets/swagger-ui.css",
                               swagger_favicon_url="/docs-assets/favicon-32x32.png")


# The page's policy: its own scripts, styles and API only (inline styles for the charts;
# images also from data: and blob: URLs, the overlays and the uploaded picture). /docs needs
# the one inline script get_swagger_ui_html writes to start Swagger UI.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'self'; "
       "frame-ancestors 'none'; form-action 'self'")
DOCS_CSP = CSP.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'")


class SecurityHeadersMiddleware:
    """Content-Security-Policy and friends on every response (pure ASGI: no buffering)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = DOCS_CSP if scope.get("path") == "/docs" else CSP

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", policy)
                headers.setdefault("X-Content-Type-Options", "nosniff")
                headers.setdefault("Referrer-Policy", "no-referrer")
                headers.setdefault("X-Frame-Options", "DENY")
            await send(message)

        await self.app(scope, receive, with_headers)


def mount_ui(app: FastAPI) -> None:
    import swagger_ui_bundle

    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
    app.mount("/docs-assets", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path),
              name="docs-assets")
