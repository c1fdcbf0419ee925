"""The inference engine: scheduler, block manager, model runner, sampler, and its two front ends."""
from engine.config import EngineConfig
from engine.errors import PromptRejected
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker import RequestOutput, Worker

__all__ = ["LLM", "SamplingParams", "EngineConfig", "PromptRejected", "Worker", "RequestOutput"]
