"""MLflow: where runs go, how a trained model bundle is logged, registered and promoted, and how
it is fetched back for serving.

The tracking URI comes from ``MLFLOW_TRACKING_URI`` (see :mod:`vit_service.config`), by default a
local SQLite database with a local artifact folder. Registered models carry their bundle
(:mod:`vit_service.bundle`) as artifacts; the alias ``champion`` is moved only when a new
version's validation accuracy beats the current champion's.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from vit_service.bundle import load_bundle
from vit_service.config import Settings, get_settings

log = logging.getLogger(__name__)

CHAMPION = "champion"
BUNDLE_ARTIFACT = "bundle"  # key of the bundle folder inside the pyfunc model's artifacts


def configure(tracking_uri: str | None = None, settings: Settings | None = None) -> str:
    """Point MLflow at ``tracking_uri`` (or the settings' one) and return it."""
    settings = settings or get_settings()
    uri = tracking_uri or settings.resolved_tracking_uri
    init_sqlite_store(uri)
    mlflow.set_tracking_uri(uri)
    return uri


def init_sqlite_store(uri: str) -> None:
    """Make a local SQLite tracking store's tables once, under a file lock beside the file.

    MLflow creates and migrates a fresh database's tables in whichever process opens it
    first, unguarded: a server and a trainer (or two trainers) opening a new home's database
    together both migrate it, and one fails (``table _alembic_tmp_tags already exists``).
    Under the lock the first one makes the tables and the others then find them made.
    Any other URI (a tracking server, PostgreSQL) is left alone: the server owns its schema.
    """
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    lock = Path(f"{db}.init-lock")
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    except OSError as e:  # a read-only folder: nobody can migrate it; open it as it is
        log.debug("no lock beside %s (%s): opening it unlocked", db, e)
        return
    with _flocked(lock):
        MlflowClient(uri, uri).search_experiments(max_results=1)  # runs the migrations


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (made if missing), held for the block."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_experiment(name: str, settings: Settings | None = None) -> str:
    """Experiment id for ``name``, created with a local artifact folder for database URIs."""
    settings = settings or get_settings()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if mlflow.get_tracking_uri().startswith(("sqlite:", "postgresql:", "mysql:")):
        root = settings.artifact_root / name
        root.mkdir(parents=True, exist_ok=True)
        location = root.as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


class BundlePyfunc(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc wrapper so a registered model also works with ``mlflow models serve``.

    Input: a DataFrame with a column ``image`` (base64-encoded image bytes) or ``text``.
    Output: one row per input with ``label``, ``index`` and ``probability``, computed in the
    precision the REST API answers in (``VIT_SERVICE_INFERENCE_PRECISION``, default auto: bf16
    on a CPU with native bf16), so both give the same answers.
    """

    def load_context(self, context: Any) -> None:
        from vit_service.config import Settings
        from vit_service.precision import resolve_precision

        self.bundle = load_bundle(context.artifacts[BUNDLE_ARTIFACT])
        self.precision = resolve_precision(Settings().inference_precision)

    def predict(self, context: Any, model_input: Any, params: Any = None) -> Any:
        import pandas as pd
        import torch

        from vit_service.precision import inference_precision
        from vit_service.preprocess import decode_image, images_to_tensor
        from vit_service.tta import predict

        b = self.bundle
        if not b.meta.class_names:
            raise ValueError("this model is a pretrained encoder (no classes): fine-tune it "
                             "(recipe init.from) before predicting")
        with torch.inference_mode(), inference_precision(b.model, self.precision):
            if b.meta.task == "image":
                imgs = [decode_image(base64.b64decode(s)) for s in model_input["image"]]
                logits = predict(b.model, images_to_tensor(imgs, b.meta))  # flip TTA too
            else:
                texts = list(model_input["text"])
                enc = b.tokenizer.encode_batch(texts, b.meta.preprocess["max_len"],
                                               b.meta.preprocess.get("truncation", "head"))
                logits = b.model(enc.input_ids, enc.attention_mask)
        probs = logits.float().softmax(-1)
        p, idx = probs.max(-1)
        return pd.DataFrame(
            {
                "label": [b.meta.class_names[i] for i in idx.tolist()],
                "index": idx.tolist(),
                "probability": p.tolist(),
            }
        )


def log_bundle(
    bundle_dir: str | Path, task: str, registered_name: str | None = None
) -> str | None:
    """Log the bundle as a pyfunc model in the active run; register it if a name is given.

    A pretrained encoder's bundle (no class names) is logged without an input example: it
    does not predict labels, it is what fine-tuning starts from.
    Returns the new registered version (as a string) or ``None``.
    """
    info = mlflow.pyfunc.log_model(name="model", registered_model_name=registered_name,
                                   **_pyfunc_kwargs(bundle_dir, task))
    version = info.registered_model_version
    return str(version) if version is not None else None


def save_bundle_model(bundle_dir: str | Path, task: str, path: str | Path) -> Path:
    """The pyfunc model :func:`log_bundle` logs, written to a local folder instead (nothing is
    logged): what a training run in budget mode times to know what its end costs."""
    mlflow.pyfunc.save_model(path=str(path), **_pyfunc_kwargs(bundle_dir, task))
    return Path(path)


def _pyfunc_kwargs(bundle_dir: str | Path, task: str) -> dict[str, Any]:
    import json

    import pandas as pd
    from mlflow.models import infer_signature

    col = "image" if task == "image" else "text"
    example_in = pd.DataFrame({col: [_example_input(task)]})
    example_out = pd.DataFrame({"label": ["x"], "index": [0], "probability": [0.5]})
    meta = json.loads((Path(bundle_dir) / "meta.json").read_text())
    classifier = bool(meta.get("class_names"))
    return {"python_model": BundlePyfunc(),
            "artifacts": {BUNDLE_ARTIFACT: str(bundle_dir)},
            "signature": infer_signature(example_in, example_out if classifier else None),
            "input_example": example_in if classifier else None,
            "pip_requirements": ["vit-service", "torch", "pillow", "tokenizers", "pandas"]}


def _example_input(task: str) -> str:
    if task == "text":
        return "A moving, beautifully shot film."
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 60, 200)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


SPLIT_PARAM = "eval.split_fingerprint"  # sha256 of the validation inputs and labels


def promote_champion(
    name: str, version: str, metric: str = "val_acc", client: MlflowClient | None = None,
    lock_dir: Path | None = None,
) -> bool:
    """Move the ``champion`` alias to ``version`` iff its run's ``metric`` beats the champion's
    *on the same validation split* (the runs' :data:`SPLIT_PARAM` fingerprints match: a run
    that shrank its ``val_size`` cannot win with 100 %). Check and move hold an exclusive lock
    on ``<lock_dir>/champion-<name>.lock`` (default: the service's home, which every trainer
    of a deployment shares), so two runs finishing together cannot both win."""
    client = client or MlflowClient()
    lock_dir = lock_dir or get_settings().home
    lock_dir.mkdir(parents=True, exist_ok=True)
    with _flocked(lock_dir / f"champion-{name}.lock"):
        return _promote(name, version, metric, client)


def _promote(name: str, version: str, metric: str, client: MlflowClient) -> bool:
    new = client.get_model_version(name, version)
    new_run = client.get_run(new.run_id)
    new_score = new_run.data.metrics.get(metric)
    try:
        cur = client.get_model_version_by_alias(name, CHAMPION)
        cur_run = client.get_run(cur.run_id)
        cur_score = cur_run.data.metrics.get(metric)
    except MlflowException:
        cur, cur_run, cur_score = None, None, None
    if cur is not None and cur_run is not None and cur_score is not None:
        split_new = new_run.data.params.get(SPLIT_PARAM)
        split_cur = cur_run.data.params.get(SPLIT_PARAM)
        if split_cur is not None and split_new != split_cur:
            log.info("%s v%s was scored on another validation split (%s) than champion v%s "
                     "(%s): not comparable, alias unchanged", name, version, split_new,
                     cur.version, split_cur)
            return False
        if new_score is None or new_score <= cur_score:
            log.info("%s v%s (%s=%s) does not beat champion v%s (%s); alias unchanged",
                     name, version, metric, new_score, cur.version, cur_score)
            return False
    client.set_registered_model_alias(name, CHAMPION, version)
    log.info("%s v%s is now %s (%s=%s)", name, version, CHAMPION, metric, new_score)
    return True


@dataclass
class ModelRef:
    """Which registered model version a URI resolved to."""

    name: str
    version: str
    run_id: str | None
    alias: str | None
    source: str


def resolve_model(uri_or_name: str, client: MlflowClient | None = None) -> ModelRef:
    """``name`` (-> ``@champion``), ``models:/name@alias`` or ``models:/name/version``."""
    client = client or MlflowClient()
    uri = uri_or_name if uri_or_name.startswith("models:/") else f"models:/{uri_or_name}@{CHAMPION}"
    body = uri.removeprefix("models:/")
    if "@" in body:
        name, alias = body.split("@", 1)
        mv = client.get_model_version_by_alias(name, alias)
    else:
        name, _, ver = body.partition("/")
        alias = None
        mv = client.get_model_version(name, ver)
    return ModelRef(name=name, version=str(mv.version), run_id=mv.run_id, alias=alias,
                    source=mv.source)


def download_bundle(ref: ModelRef, dst: str | Path | None = None) -> Path:
    """Download a registered version's bundle folder and return its local path."""
    return download_bundle_uri(f"models:/{ref.name}/{ref.version}", dst)


def download_bundle_uri(artifact_uri: str, dst: str | Path | None = None) -> Path:
    """Download a logged model (``models:/name/version``, ``runs:/<run_id>/model``...) and
    return the local path of the bundle folder inside it."""
    dst = Path(dst or tempfile.mkdtemp(prefix="vit-service-model-"))
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst)))
    path = bundle_dir_in_model(local)
    if path is None:
        raise FileNotFoundError(f"{artifact_uri} holds no vit-service bundle")
    return path


def bundle_dir_in_model(model_dir: str | Path) -> Path | None:
    """The bundle folder inside a downloaded pyfunc model folder, or ``None``.

    MLflow keeps the logged folder's own name (``artifacts/<basename>``), so the path is read
    from the ``MLmodel`` file rather than assumed to be ``artifacts/bundle``.
    """
    import yaml

    model_dir = Path(model_dir)
    candidates: list[Path] = []
    mlmodel = model_dir / "MLmodel"
    if mlmodel.is_file():
        spec = yaml.safe_load(mlmodel.read_text()) or {}
        art = spec.get("flavors", {}).get("python_function", {}).get("artifacts") or {}
        rel = (art.get(BUNDLE_ARTIFACT) or {}).get("path")
        if rel:
            candidates.append(model_dir / rel)
    candidates.append(model_dir / "artifacts" / BUNDLE_ARTIFACT)
    for c in candidates:
        if (c / "meta.json").is_file():
            return c
    return None
