"""slora-batch: offline batch inference of one base LLM with thousands of LoRA adapters."""

from slora_batch.config import EngineConfig, SamplingConfig
from slora_batch.engine import Engine
from slora_batch.request import Request, Result

__all__ = ["Engine", "EngineConfig", "Request", "Result", "SamplingConfig"]
