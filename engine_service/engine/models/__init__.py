from engine_service.engine.models.loader import load_config, load_tokenizer, load_weights, resolve_model
from engine_service.engine.models.registry import DEFAULT_MODEL, REGISTRY, ModelNotInstalledError, available_models

__all__ = ["DEFAULT_MODEL", "REGISTRY", "ModelNotInstalledError", "available_models",
           "load_config", "load_tokenizer", "load_weights", "resolve_model"]
