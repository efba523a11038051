"""The offline engine: paged KV cache, continuous batching, the four decoding modes. Imports kernels, nothing of
the service."""
from engine_service.engine.config import EngineConfig
from engine_service.engine.llm import LLM
from engine_service.engine.llm_engine import LLMEngine
from engine_service.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine_service.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics"]
