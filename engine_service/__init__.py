"""DecodeLab: `engine` (the offline engine), `server` (Redis replica, HTTP, play), `bench`, `cli`.

`from engine_service import LLM, SamplingParams` works as in vLLM; the names load on first use, so the
command line and the service modules do not import torch until they need the engine.
"""
_ENGINE_NAMES = ("LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
                 "RequestMetrics")
__all__ = list(_ENGINE_NAMES)


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from engine_service import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'engine_service' has no attribute {name!r}")
