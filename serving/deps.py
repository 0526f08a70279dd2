"""FastAPI dependencies and their ``Annotated`` aliases (``SettingsDep``, ``StoreDep``...).

They are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in its thread pool,
a thread hop per dependency per request for what are attribute look-ups.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serving.errors import (
    AuthError,
    ForbiddenError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotLoadedError,
    UnsupportedMediaTypeError,
)
from serving.inference import InferenceService
from serving.metrics import ServingMetrics
from serving.model_cards import ModelCards
from serving.model_store import LoadedModel, ModelStore
from vit_service.config import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> ModelStore:
    return request.app.state.store


async def get_service(request: Request) -> InferenceService:
    return request.app.state.service


async def get_metrics(request: Request) -> ServingMetrics:
    return request.app.state.metrics


async def get_cards(request: Request) -> ModelCards:
    return request.app.state.cards


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[ModelStore, Depends(get_store)]
ServiceDep = Annotated[InferenceService, Depends(get_service)]
MetricsDep = Annotated[ServingMetrics, Depends(get_metrics)]
CardsDep = Annotated[ModelCards, Depends(get_cards)]


def loaded_model(store: ModelStore, name: str, task: str) -> LoadedModel:
    """The served version of ``name``: 404 if not configured, 503 if not loaded, 422 if it is
    a model for the other task."""
    if not store.is_configured(name):
        raise ModelNotFoundError(name, store.names)
    model = store.get(name)
    if model is None:
        raise ModelNotLoadedError(name, store.error(name))
    if model.task != task:
        raise InvalidRequestError(f"model {name!r} is a {model.task} model, not a {task} model")
    return model


async def configured_model_name(name: str, store: StoreDep) -> str:
    """Path parameter ``name`` of a configured model (else 404)."""
    if not store.is_configured(name):
        raise ModelNotFoundError(name, store.names)
    return name


ModelNameDep = Annotated[str, Depends(configured_model_name)]

_bearer = HTTPBearer(auto_error=False, description="an API key: VIT_SERVICE_API_KEY or one of "
                     "VIT_SERVICE_API_KEYS")


async def require_api_key(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """Bearer auth for mutating routes: the name of the principal whose key was given
    (``default`` for VIT_SERVICE_API_KEY); refused outright (403) when no key is configured.

    The key is compared with every configured key, each in constant time and none skipped
    after a match, so the time taken says neither which key matched nor how far a guess got.
    """
    principals = settings.principals
    if not principals:
        raise ForbiddenError("this route is disabled: no API key is configured (set "
                             "VIT_SERVICE_API_KEY or VIT_SERVICE_API_KEYS)")
    given = (credentials.credentials if credentials is not None else "").encode()
    found: str | None = None
    for name, key in principals.items():
        if hmac.compare_digest(given, key.encode()) and found is None:
            found = name
    if credentials is None or found is None:
        raise AuthError()
    return found


ApiKeyDep = Depends(require_api_key)
# the caller's principal, for routes that record it (FastAPI runs the check once per request,
# also when the router's ApiKeyDep asks for it too)
PrincipalDep = Annotated[str, Depends(require_api_key)]


async def require_json(request: Request) -> None:
    """415 unless the body is declared as JSON."""
    ctype = request.headers.get("content-type", "")
    main = ctype.split(";", 1)[0].strip().lower()
    if not (main == "application/json" or (main.startswith("application/")
                                           and main.endswith("+json"))):
        raise UnsupportedMediaTypeError(ctype, ["application/json"])


JsonBodyDep = Depends(require_json)
