from engine_service.config import EngineConfig
from engine_service.llm import LLM
from engine_service.llm_engine import LLMEngine
from engine_service.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine_service.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics"]
