"""``GET /v1/models``, ``GET /v1/models/{name}`` and ``POST /v1/models/{name}/reload``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from fastapi.concurrency import run_in_threadpool

from serving.deps import ApiKeyDep, CardsDep, ModelNameDep, StoreDep
from serving.errors import ModelNotLoadedError, error_responses
from serving.model_store import ModelLoadError, ModelStore
from serving.schemas import ModelCard, ModelEntry, ModelsResponse, ReloadResponse

router = APIRouter(prefix="/models", tags=["models"])


def model_entry(store: ModelStore, name: str) -> ModelEntry:
    m = store.get(name)
    if m is None:
        return ModelEntry(name=name, source=store.source(name), loaded=False,
                          error=store.error(name))
    return ModelEntry(
        name=name, source=m.source, loaded=True, task=m.task, version=m.version, alias=m.alias,
        run_id=m.run_id, run_url=m.run_url, classes=m.class_names, input=m.input_spec(),
        architecture=m.bundle.meta.model_config, loaded_at=m.loaded_at,
        load_seconds=round(m.load_seconds, 4), precision=m.precision,
        served_val_acc=m.served_val_acc, relevance=m.relevance_unavailable is None,
        relevance_unavailable=m.relevance_unavailable, error=store.error(name),
    )


@router.get("", response_model=ModelsResponse, summary="Served models")
async def list_models(store: StoreDep) -> ModelsResponse:
    """Every configured model: the loaded version (name, version, alias, run and a link to it
    in the MLflow UI), its classes and input spec; ``loaded: false`` with the last load error
    for those not available yet."""
    return ModelsResponse(models=[model_entry(store, n) for n in store.names])


@router.get("/{name}", response_model=ModelEntry, summary="One served model",
            responses=error_responses(404))
async def get_model(name: ModelNameDep, store: StoreDep) -> ModelEntry:
    return model_entry(store, name)


@router.get("/{name}/card", response_model=ModelCard, summary="The served version's card",
            responses=error_responses(404, 503))
async def model_card(name: ModelNameDep, store: StoreDep, cards: CardsDep) -> ModelCard:
    """Recipe, size, validation accuracy, per-class recall and confusion matrix of the loaded
    version (from its bundle and its MLflow run; cached per version)."""
    m = store.get(name)
    if m is None:
        raise ModelNotLoadedError(name, store.error(name))
    return ModelCard.model_validate(await run_in_threadpool(cards.card, m))


@router.post(
    "/{name}/reload",
    response_model=ReloadResponse,
    summary="Re-resolve the model's source and swap in a new version",
    dependencies=[ApiKeyDep],
    responses=error_responses(401, 403, 404, 503),
)
async def reload_model(
    name: ModelNameDep,
    store: StoreDep,
    force: Annotated[bool, Query(description="reload even if the version is unchanged")] = False,
) -> ReloadResponse:
    """Requires ``Authorization: Bearer <VIT_SERVICE_API_KEY>`` (403 when no key is
    configured). The new version is loaded while the old one keeps serving, then swapped in."""
    try:
        result = await store.refresh(name, force=force)
    except ModelLoadError as e:
        raise HTTPException(status_code=503, detail=f"cannot load {name!r}: {e}") from e
    return ReloadResponse(name=name, reloaded=result.reloaded,
                          previous_version=result.previous_version,
                          model=model_entry(store, name))
