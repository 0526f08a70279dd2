"""Data sets (CIFAR-10, any ImageFolder tree, IMDb), tokenizer and splits.

Loaders accept the official distributions and this project's archives, decode once into an
on-disk cache (``cache_dir`` > ``$VIT_SERVICE_CACHE_DIR`` > ``~/.cache/vit-service``) and raise
:class:`DataNotFoundError` listing where they looked.
"""

from vit_service.data.cache import resolve_cache_dir
from vit_service.data.cifar import CIFAR10_CLASSES, load_cifar10
from vit_service.data.errors import DataNotFoundError
from vit_service.data.image_folder import load_image_folder, load_image_folder_train
from vit_service.data.images import ImageDataset
from vit_service.data.imdb import IMDB_URL, TextDataset, clean_review, load_imdb
from vit_service.data.splits import (
    DEFAULT_VAL_IMAGES,
    DEFAULT_VAL_REVIEWS,
    split_indices,
    stratified_split,
)
from vit_service.data.tokenizer import (
    SPECIAL_TOKENS,
    Encoded,
    TextTokenizer,
    train_tokenizer,
)

__all__ = [
    "CIFAR10_CLASSES",
    "DEFAULT_VAL_IMAGES",
    "DEFAULT_VAL_REVIEWS",
    "IMDB_URL",
    "SPECIAL_TOKENS",
    "DataNotFoundError",
    "Encoded",
    "ImageDataset",
    "TextDataset",
    "TextTokenizer",
    "clean_review",
    "load_cifar10",
    "load_image_folder",
    "load_image_folder_train",
    "load_imdb",
    "resolve_cache_dir",
    "split_indices",
    "stratified_split",
    "train_tokenizer",
]
