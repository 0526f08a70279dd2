"""vit-service: train, compare and serve Vision Transformers, with their attention maps."""

__version__ = "0.1.0"
