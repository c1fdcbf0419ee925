"""Model definitions and loading: `load_model(path, dtype, device)` is the way in."""

from models.registry import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
